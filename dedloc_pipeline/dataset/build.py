"""Making a data set from an organizer's corpus, in steps that each hold a bounded share of it.

``start`` lists the sources' pieces (JOB.json); per piece, ``survey`` reads its documents'
digests and sizes; ``decide`` makes the plan (``dataset/plan.py``: duplicates, held-out
documents, the tokenizer's sample, partitions); per piece, ``sample`` writes the sample's
sentences; ``train`` fits the tokenizer on them; per piece, ``tokenize`` makes each kept
document's sentence-order pairs and files them by partition; per partition, ``pack`` sorts its
pairs into the canonical order, shuffles them (seeded) and writes its shards; ``finish`` writes
the card (DATA.json) last and removes the records. Each step's output is created once under the
recipe's folder with a record of it written last, so a run killed anywhere resumes at the first
step without one, and the data set (shards, tokenizer and card) is the same bit for bit however
the corpus was cut into files, the steps split among workers, or the run resumed.

``make`` runs the steps in this process or on ``jobs`` processes; the tokenize flow
(flows/tokenization.py) maps the same steps as Prefect tasks on any of its task runners.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..model import packing, tokenizer as tokenizers
from ..storage.bucket import Bucket
from ..storage.layout import DataLayout
from . import plan as planning
from .sources import Piece, Source, SourceError, documents, pieces, sentences

FLUSH_PAIRS = 8192  # a piece's pairs held before they go to the parts: its memory, whatever its size
TOKENIZE_DOCUMENTS = 256  # documents tokenized in one call
MB = 1_000_000


class Recipe(BaseModel):
    """What a data set is made from and how; DATA.json records it, and a run made with the same
    recipe keeps the data set there."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sources: tuple[Source, ...]
    vocab_size: int = 8000
    seq_len: int = 128
    seed: int = 0
    heldout_fraction: float = 0.02
    max_documents: int | None = None  # the first documents in the canonical order: a trial's data set
    sample_mb: float = 64.0  # text the tokenizer is trained on, at most
    partition_mb: float = 64.0  # text per partition: what one ``pack`` holds as pairs
    shard_pairs: int = 512

    def id(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class Job(BaseModel):
    """A recipe being made into data set ``name``, and the pieces its sources held when it started."""

    name: str
    recipe: Recipe
    pieces: list[Piece]
    started_at: float

    @property
    def layout(self) -> DataLayout:
        return DataLayout(self.name)

    @property
    def id(self) -> str:
        return self.recipe.id()


# the steps

def start(bucket: Bucket, name: str, recipe: Recipe, storage_options: dict | None = None) -> Job:
    """The job of making ``recipe`` into ``name``: listed now, or as a run before listed it
    (its pieces still the same size: a source changed meanwhile is refused)."""
    keys, rid = DataLayout(name), recipe.id()
    found = pieces(list(recipe.sources), storage_options)
    raw = bucket.read_bytes(keys.job(rid))
    if raw is None:
        job = Job(name=name, recipe=recipe, pieces=found, started_at=time.time())
        bucket.create(keys.job(rid), job.model_dump_json().encode())  # or another process's, read next
        raw = bucket.read_bytes(keys.job(rid))  # another process may have started it first
    job = Job.model_validate_json(raw)
    if [(p.url, p.size) for p in job.pieces] != [(p.url, p.size) for p in found]:
        raise SourceError(f"data set {name!r}: its sources changed since this recipe was started "
                          f"({keys.work(rid)}); delete that folder to start again")
    return job


def survey(bucket: Bucket, job: Job, i: int, storage_options: dict | None = None) -> int:
    """Piece i's documents' digests and sizes; the number of documents."""
    key = job.layout.survey(job.id, i)
    if (raw := bucket.read_bytes(key)) is not None:
        return int(_load(raw)["sizes"].shape[0])
    digests, sizes = [], []
    for doc in _documents(job, i, storage_options):
        digests.append(planning.digest(doc))
        sizes.append(len(doc.encode("utf-8")))
    arr = np.frombuffer(b"".join(digests), np.uint8).reshape(-1, planning.DIGEST)
    _create(bucket, key, _npz(digests=arr, sizes=np.asarray(sizes, np.int64)))
    return len(sizes)


def decide(bucket: Bucket, job: Job) -> dict:
    """The plan, from every piece's survey: each piece's decisions, then the summary (PLAN.json)."""
    keys, rid, r = job.layout, job.id, job.recipe
    if (done := bucket.read_json(keys.plan(rid))) is not None:
        return done
    surveys = [_load(_read(bucket, keys.survey(rid, i))) for i in range(len(job.pieces))]
    decided, summary = planning.plan([s["digests"] for s in surveys], [s["sizes"] for s in surveys], r.seed,
                                     r.heldout_fraction, r.max_documents, int(r.sample_mb * MB),
                                     int(r.partition_mb * MB))
    if summary["documents"] < 2:
        raise SourceError(f"data set {job.name!r}: {summary['documents']} distinct documents in its sources; "
                          "a data set needs at least 2 (one held out)")
    for i, d in enumerate(decided):
        _create(bucket, keys.plan(rid, i), _npz(**d))
    _create(bucket, keys.plan(rid), _json(summary))
    return summary


def sample(bucket: Bucket, job: Job, i: int, storage_options: dict | None = None) -> int:
    """Piece i's share of the tokenizer's sample: its sampled documents, a JSON line each
    (``[order, sentences]``); the number of documents."""
    key = job.layout.sample(job.id, i)
    if (raw := bucket.read_bytes(key)) is not None:
        return raw.count(b"\n")
    d = _load(_read(bucket, job.layout.plan(job.id, i)))
    lines = [json.dumps([int(d["order"][j]), sentences(doc)], ensure_ascii=False) + "\n"
             for j, doc in enumerate(_documents(job, i, storage_options)) if d["sample"][j]]
    _create(bucket, key, "".join(lines).encode("utf-8"))
    return len(lines)


def train(bucket: Bucket, job: Job):
    """The tokenizer, trained on the sample's sentences in the canonical order (so on the same
    text in the same order however the corpus was cut into files), saved under the data set; one
    trained before under this recipe is loaded."""
    keys, rid = job.layout, job.id
    if bucket.read_json(keys.trained(rid)) is None:
        docs = [json.loads(line) for i in range(len(job.pieces))
                for line in _read(bucket, keys.sample(rid, i)).decode("utf-8").splitlines()]
        docs.sort(key=lambda d: d[0])
        tok = tokenizers.train((s for _, ss in docs for s in ss), job.recipe.vocab_size)
        files = tokenizers.save(tok, bucket, keys.tokenizer)
        _create(bucket, keys.trained(rid), _json({k: _hash(_read(bucket, k)) for k in files}))
    return tokenizers.load(bucket, keys.tokenizer)


def tokenize(bucket: Bucket, job: Job, i: int, tok, storage_options: dict | None = None) -> dict:
    """Piece i's kept documents as sentence-order pairs, each document's drawn with its own
    seeded generator, filed to their partitions in chunks of at most ``FLUSH_PAIRS``; the record."""
    keys, rid, r = job.layout, job.id, job.recipe
    if (done := bucket.read_json(keys.tokenized(rid, i))) is not None:
        return done
    d = _load(_read(bucket, keys.plan(rid, i)))
    held: list[tuple] = []  # (partition, order, pair index, heldout, pair)
    chunks, pairs, docs = 0, 0, 0

    def flush() -> None:
        nonlocal chunks
        for p in sorted({h[0] for h in held}):
            mine = [h for h in held if h[0] == p]
            arrays = packing.pack([h[4] for h in mine], r.seq_len)
            _create(bucket, keys.part(rid, p, i, chunks), _npz(
                **arrays, order=np.array([h[1] for h in mine], np.uint64), index=np.array([h[2] for h in mine],
                                                                                         np.uint32),
                heldout=np.array([h[3] for h in mine], bool)))
        chunks += 1
        held.clear()

    kept = ((doc, j) for j, doc in enumerate(_documents(job, i, storage_options)) if d["keep"][j])
    for batch in _batches(kept, TOKENIZE_DOCUMENTS):
        split = [sentences(doc) for doc, _ in batch]
        flat = [s for ss in split for s in ss]
        ids = [e.ids for e in tok.backend_tokenizer.encode_batch(flat, add_special_tokens=False)]
        at = 0
        for (_, j), ss in zip(batch, split):
            doc_ids, at = ids[at:at + len(ss)], at + len(ss)
            rng = np.random.default_rng([r.seed, int(d["draws"][j])])
            for k, pair in enumerate(packing.sop_pairs(doc_ids, r.seq_len - 3, rng)):
                held.append((int(d["partition"][j]), int(d["order"][j]), k, bool(d["heldout"][j]), pair))
                pairs += 1
            docs += 1
            if len(held) >= FLUSH_PAIRS:
                flush()
    if held:
        flush()
    record = {"documents": docs, "pairs": pairs, "chunks": chunks}
    _create(bucket, keys.tokenized(rid, i), _json(record))
    return record


def pack(bucket: Bucket, job: Job, p: int, vocab: int) -> dict:
    """Partition p's pairs from every piece, in the canonical order (the documents' seeded order,
    then each one's pairs in turn), shuffled with a generator seeded by (seed, p, split), written
    as shards; the record (each split's shards, tokens, swapped pairs; token counts apart)."""
    keys, rid, r = job.layout, job.id, job.recipe
    if (done := bucket.read_json(keys.packed(rid, p))) is not None:
        return done
    parts = sorted(bucket.find(keys.parts(rid, p)))
    found = [_load(_read(bucket, k)) for k in parts]
    record: dict = {}
    counts = np.zeros(vocab, np.int64)
    for s, split in enumerate(("heldout", "train")):
        rows = {name: np.concatenate([f[name][f["heldout"] == (split == "heldout")] for f in found])
                if found else np.zeros(0) for name in ("input_ids", "b_start", "length", "sentence_order_label",
                                                       "order", "index")}
        n = len(rows["length"])
        canon = np.lexsort((rows["index"], rows["order"])) if n else np.zeros(0, int)
        perm = canon[np.random.default_rng([r.seed, p, s]).permutation(n)] if n else canon
        shards = []
        for j, at in enumerate(range(0, n, r.shard_pairs)):
            take = perm[at:at + r.shard_pairs]
            data = _npz(**{name: rows[name][take] for name in ("input_ids", "b_start", "length",
                                                              "sentence_order_label")})
            key = keys.shard(rid, split, p, j)
            _create(bucket, key, data)
            shards.append({"key": key, "pairs": len(take), "blake2b": _hash(data)})
        tokens = rows["input_ids"][_text_tokens(rows)] if n else np.zeros(0, np.int64)
        if split == "train":
            counts += np.bincount(tokens, minlength=vocab)[:vocab]
        record[split] = {"pairs": n, "tokens": int(rows["length"].sum()) if n else 0,
                         "swapped": int(rows["sentence_order_label"].sum()) if n else 0, "shards": shards}
    _create(bucket, keys.counts(rid, p), _npz(counts=counts))
    _create(bucket, keys.packed(rid, p), _json(record))
    return record


def finish(bucket: Bucket, job: Job, tok, summary: dict) -> dict:
    """DATA.json, from the partitions' records, written last; then the records go, and the
    shards of a data set made before under this name that the card no longer lists."""
    keys, rid, r = job.layout, job.id, job.recipe
    packed = [bucket.read_json(keys.packed(rid, p)) for p in range(summary["partitions"])]
    counts = sum(_load(_read(bucket, keys.counts(rid, p)))["counts"] for p in range(summary["partitions"]))
    card = {"name": job.name, "seq_len": r.seq_len, "seed": r.seed, "vocab_size": len(tok),
            "tokenizer": keys.tokenizer, "documents": summary["documents"],
            "sources": _provenance(job, summary), "recipe": r.model_dump(mode="json"),
            "objective": "masked LM (15%, dynamic) + sentence-order prediction", "splits": {}}
    for split in ("heldout", "train"):
        pairs = sum(x[split]["pairs"] for x in packed)
        if not pairs:
            raise SourceError(f"data set {job.name!r}: no {split} pairs (too little text)")
        card["splits"][split] = {"pairs": pairs, "tokens": sum(x[split]["tokens"] for x in packed),
                                 "swapped": sum(x[split]["swapped"] for x in packed) / pairs,
                                 "shards": [s for x in packed for s in x[split]["shards"]]}
    p = counts[counts > 0] / counts.sum()
    card["unigram_entropy"] = float(-(p * np.log(p)).sum())
    data = _npz(counts=counts)
    bucket.write_bytes(keys.unigram, data)
    card["unigram"] = {"key": keys.unigram, "blake2b": _hash(data)}
    first = _load(_read(bucket, card["splits"]["train"]["shards"][0]["key"]))
    card["preview"] = [tok.decode(row[:n]) for row, n in zip(first["input_ids"][:2], first["length"][:2])]
    card["created_at"] = job.started_at  # the job's: a resumed run writes the same card
    bucket.write_json(keys.card, card)
    listed = {s["key"] for split in card["splits"].values() for s in split["shards"]}
    for folder in keys.splits():  # a data set made before under this name: its shards, now unlisted
        bucket.delete(folder, only=lambda k: k not in listed)
    bucket.delete(keys.work(rid))
    return card


# the steps in order

def make(bucket: Bucket, name: str, recipe: Recipe, pool: Executor | None = None,
         progress: Callable[[str, int, int], None] | None = None, storage_options: dict | None = None) -> dict:
    """Data set ``name`` made from ``recipe`` (kept if its card already has that recipe): the
    steps in order, each piece's and partition's on ``pool`` (threads or processes) when given.
    ``progress(step, done, total)`` is told as each piece or partition is done (0 at a step's start)."""
    card = bucket.read_json(DataLayout(name).card)
    if card is not None and card.get("recipe") == recipe.model_dump(mode="json"):
        return card
    tell = progress or (lambda step, done, total: None)

    def each(step: str, fn: Callable, calls: list[tuple]) -> None:
        tell(step, 0, len(calls))
        for n, _ in enumerate(_run(pool, fn, calls), 1):
            tell(step, n, len(calls))

    job = start(bucket, name, recipe, storage_options)
    pieces_ = range(len(job.pieces))
    each("survey", survey, [(bucket, job, i, storage_options) for i in pieces_])
    summary = decide(bucket, job)
    each("sample", sample, [(bucket, job, i, storage_options) for i in pieces_])
    tell("train", 0, 1)
    tok = train(bucket, job)
    tell("train", 1, 1)
    each("tokenize", tokenize, [(bucket, job, i, tok, storage_options) for i in pieces_])
    each("pack", pack, [(bucket, job, p, len(tok)) for p in range(summary["partitions"])])
    return finish(bucket, job, tok, summary)


def _run(pool: Executor | None, fn: Callable, calls: list[tuple]) -> Iterable:
    if pool is None:
        return (fn(*args) for args in calls)
    return (f.result() for f in [pool.submit(fn, *args) for args in calls])


# helpers

def _documents(job: Job, i: int, storage_options: dict | None) -> Iterator[str]:
    piece = job.pieces[i]
    return documents(piece, job.recipe.sources[piece.source], storage_options)


def _batches(items: Iterable, n: int) -> Iterator[list]:
    batch: list = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _text_tokens(rows: dict) -> np.ndarray:
    """A boolean mask of the tokens of segments A and B (not [CLS], the [SEP]s or padding)."""
    pos = np.arange(rows["input_ids"].shape[1])[None, :]
    b, n = rows["b_start"][:, None], rows["length"][:, None]
    return ((pos >= 1) & (pos < b - 1)) | ((pos >= b) & (pos < n - 1))


def _provenance(job: Job, summary: dict) -> dict:
    out = {"summary": summary, "sources": []}
    for i, src in enumerate(job.recipe.sources):
        mine = [p for p in job.pieces if p.source == i]
        out["sources"].append({"url": src.url, "licence": src.licence, "pieces": len(mine),
                               "bytes": sum(p.size for p in mine)})
    return out


def _npz(**arrays: np.ndarray) -> bytes:
    """``np.savez_compressed``'s format, without its clock: each member dated 1980-01-01, so the
    same arrays are the same bytes whenever they are written."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in arrays.items():
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            member.compress_type = zipfile.ZIP_DEFLATED
            with z.open(member, "w") as f:
                np.lib.format.write_array(f, np.asanyarray(arr), allow_pickle=False)
    return buf.getvalue()


def _load(raw: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _read(bucket: Bucket, key: str) -> bytes:
    raw = bucket.read_bytes(key)
    if raw is None:
        raise FileNotFoundError(f"{bucket.url}/{key} is missing (an earlier step did not finish)")
    return raw


def _create(bucket: Bucket, key: str, data: bytes) -> None:
    """Write a step's output once: there already with the same bytes is a resumed step's, with
    others a refusal (another recipe's writer, or the sources changed under it)."""
    if not bucket.create(key, data):
        raise SourceError(f"{bucket.url}/{key} is there with other bytes than this run makes: another run "
                          "writes this recipe, or its sources changed; delete the data set's work/ folder "
                          "to start again")


def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
