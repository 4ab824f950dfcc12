"""Where an organizer's text comes from: sources (fsspec URLs, the hub) cut into pieces, read as documents.

A source is a file, a folder (every text file below it), a glob, or ``hub:PATH[:CONFIG]`` (a
``datasets`` data set, streamed; PATH may be a local folder of files too). A piece is one unit
of work: a file, or one of a hub data set's shards. Files are plain text (documents separated by
blank lines, or runs of ``lines_per_document`` lines for text without breaks), JSON lines (a
text field per line) or Parquet (a text column); gzip, zstd, bz2 and xz are read through
(``.gz``, ``.zst`` ...). Nothing is held beyond one document, or one Parquet batch.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator

import fsspec
from fsspec.core import url_to_fs
from pydantic import BaseModel, ConfigDict

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "lzma"}
HUB = "hub:"
# sahajBERT's sentence ends: the danda, ? and !
_SENTENCE_END = re.compile(r"(?<=[।?!])\s+")


class Source(BaseModel):
    """One source of text as the organizer names it, with what DATA.json records of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    url: str
    licence: str | None = None
    text_field: str = "text"  # JSON lines and Parquet: the field holding a document's text
    lines_per_document: int | None = None  # plain text without blank lines: runs of this many lines


class Piece(BaseModel):
    """One unit of work: a file of a source, or one shard of a hub data set."""

    model_config = ConfigDict(frozen=True)
    source: int  # its index in the sources
    url: str
    format: str  # text | jsonl | parquet | hub
    size: int  # bytes as stored (0 for a hub shard: not known before reading)
    shard: int = 0  # a hub data set's shard
    shards: int = 1


class SourceError(ValueError):
    """A source that cannot be read as it is named."""


def embedded(corpus_dir: str) -> Source:
    """The embedded corpus (`make corpus`, model/corpus.py) as a source: the dictionary's lines,
    which have no document breaks, in runs of 12 (entries of neighbouring headwords)."""
    from ..model import corpus
    prov = corpus.build(corpus_dir)["shobdo.txt"]
    return Source(url=f"{corpus_dir}/shobdo.txt", lines_per_document=12,
                  licence=f"{prov['license']} ({prov['package']} {prov['version']}, {prov['registry']})")


def format_of(path: str) -> tuple[str | None, str | None]:
    """(format, compression) from a file's name: ``a.jsonl.zst`` is ("jsonl", "zstd")."""
    name = posixpath.basename(path).lower()  # a file's URL, not a bucket key
    compression = next((c for ext, c in COMPRESSIONS.items() if name.endswith(ext)), None)
    if compression is not None:
        name = name[:name.rindex(".")]
    fmt = next((f for ext, f in FORMATS.items() if name.endswith(ext)), None)
    return fmt, compression


def pieces(sources: list[Source], storage_options: dict | None = None) -> list[Piece]:
    """Every piece of ``sources``, in their order and each source's files sorted by name: the
    order does not depend on the machine that lists them."""
    out: list[Piece] = []
    for i, src in enumerate(sources):
        found = _hub_pieces(i, src) if src.url.startswith(HUB) else _file_pieces(i, src, storage_options or {})
        if not found:
            raise SourceError(f"source {src.url}: no text files there (.txt, .jsonl, .parquet, "
                              "optionally .gz, .zst, .bz2 or .xz)")
        out += found
    return out


def _file_pieces(i: int, src: Source, options: dict) -> list[Piece]:
    fs, path = url_to_fs(src.url, **options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if any(ch in path for ch in "*?["):
        infos = fs.glob(path, detail=True)
    elif fs.isdir(path):
        infos = fs.find(path, detail=True)
    elif fs.exists(path):
        infos = {path: fs.info(path)}
    else:
        raise SourceError(f"source {src.url}: not found")
    explicit = len(infos) == 1 and not fs.isdir(path)
    out = []
    for p in sorted(infos):
        info = infos[p]
        if info.get("type") == "directory":
            continue
        fmt, _ = format_of(p)
        if fmt is None:
            if explicit:
                raise SourceError(f"source {src.url}: not a text format this reads (.txt, .jsonl, .parquet, "
                                  "optionally compressed)")
            continue
        url = p if protocol in ("file", "local") else f"{protocol}://{p}"
        out.append(Piece(source=i, url=url, format=fmt, size=int(info.get("size") or 0)))
    return out


def _hub(src: Source, streaming: bool = True):
    import datasets  # the `eval` extra: the hub's data sets
    path, _, config = src.url[len(HUB):].partition(":")
    return datasets.load_dataset(path, config or None, split="train", streaming=streaming)


def _hub_pieces(i: int, src: Source) -> list[Piece]:
    n = _hub(src).num_shards
    return [Piece(source=i, url=src.url, format="hub", size=0, shard=k, shards=n) for k in range(n)]


def documents(piece: Piece, src: Source, storage_options: dict | None = None) -> Iterator[str]:
    """The documents of ``piece``, in order, as stored (stripped; empty ones skipped)."""
    if piece.format == "hub":
        for row in _hub(src).shard(num_shards=piece.shards, index=piece.shard):
            yield from _text(row, src, piece)
        return
    _, compression = format_of(piece.url)
    options = storage_options or {}
    if piece.format == "parquet":
        import pyarrow.parquet as pq  # the `organizer` extra
        with fsspec.open(piece.url, "rb", compression=compression, **options) as raw:
            for batch in pq.ParquetFile(raw).iter_batches(columns=[src.text_field], batch_size=1024):
                for text in batch.column(0).to_pylist():
                    if text and text.strip():
                        yield text.strip()
        return
    with fsspec.open(piece.url, "rt", compression=compression, encoding="utf-8", errors="replace",
                     **options) as lines:
        if piece.format == "jsonl":
            for n, line in enumerate(lines, 1):
                if line.strip():
                    yield from _text(_json_line(line, piece.url, n), src, piece)
        else:
            yield from _text_documents(lines, src.lines_per_document)


def _json_line(line: str, url: str, n: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{url}, line {n}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise SourceError(f"{url}, line {n}: not a JSON object")
    return row


def _text(row: dict, src: Source, piece: Piece) -> Iterator[str]:
    if src.text_field not in row:
        raise SourceError(f"{piece.url}: a record without the field {src.text_field!r} "
                          f"(it has {sorted(row)[:8]}; name the text's field with text_field)")
    text = row[src.text_field]
    if isinstance(text, str) and text.strip():
        yield text.strip()


def _text_documents(lines: Iterator[str], lines_per_document: int | None) -> Iterator[str]:
    """Blank-line separated documents, or runs of ``lines_per_document`` non-empty lines."""
    doc: list[str] = []
    for line in lines:
        line = line.strip()
        if line:
            doc.append(line)
        if doc and ((not line and lines_per_document is None) or len(doc) == lines_per_document):
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def sentences(document: str) -> list[str]:
    """A document's sentences: its lines, each split after a danda, ? or ! (as sahajBERT split them)."""
    return [s for line in document.splitlines() for s in _SENTENCE_END.split(line.strip()) if s]
