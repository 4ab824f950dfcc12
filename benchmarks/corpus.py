"""Benchmark 13: making a data set from a corpus of gigabytes (dataset/build.py), on one core and two.

``write`` makes the corpus (``make big-corpus``; never committed): the embedded corpus's Bengali
lines (`make corpus`) reshuffled and recombined, seeded, into documents of 4 to 40 lines, written
as files of the four formats an organizer brings (gzip text, zstd JSON lines, Parquet, plain text),
with one document in fifty repeated (exact duplicates to drop). ``run`` makes the data set from it
with ``dedloc data make``'s steps on two cores, and from a tenth of it on one core and on two
(``taskset``), and reports megabytes of text per second per core, each step's time, and the peak
memory of the process and of its pool against the corpus's size: what one step holds does not
grow with the corpus.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CORPUS_DIR = Path(".dedloc/corpus")
BIG = Path(".dedloc/big-corpus")
FILE_MB = 128  # text per file: 16 files for 2 GB, pieces enough for two cores
FORMATS = ("txt.gz", "jsonl.zst", "parquet", "txt")


def write(dest: Path = BIG, gb: float = 2.0, seed: int = 0) -> dict:
    """The corpus in ``dest`` (kept if its MANIFEST.json says it was made the same way)."""
    manifest = dest / "MANIFEST.json"
    recipe = {"gb": gb, "seed": seed, "file_mb": FILE_MB, "formats": FORMATS}
    if manifest.exists() and json.loads(manifest.read_text())["recipe"] == recipe:
        return json.loads(manifest.read_text())
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from dedloc_pipeline.model import corpus
    corpus.build(CORPUS_DIR)
    lines = (CORPUS_DIR / "shobdo.txt").read_text(encoding="utf-8").splitlines()
    lines += [t for _, t in (x.split("\t", 1) for x in
                             (CORPUS_DIR / "libreoffice.tsv").read_text(encoding="utf-8").splitlines())]
    rng = np.random.default_rng(seed)
    dest.mkdir(parents=True, exist_ok=True)
    files, total, docs, k = [], 0, 0, 0
    while total < gb * 1e9:
        fmt = FORMATS[k % len(FORMATS)]
        batch, size = [], 0
        while size < FILE_MB * 1e6:
            if batch and rng.random() < 0.02:
                doc = batch[int(rng.integers(len(batch)))]  # an exact duplicate
            else:
                doc = "\n".join(lines[i] for i in rng.integers(len(lines), size=int(rng.integers(4, 41))))
            batch.append(doc)
            size += len(doc.encode("utf-8"))
        path = dest / f"part-{k:03d}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.table({"text": batch}), path, row_group_size=2048)
        elif fmt == "jsonl.zst":
            with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
                for doc in batch:
                    f.write((json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8"))
        else:
            text = "\n\n".join(batch) + "\n"
            with (gzip.open(path, "wt", encoding="utf-8", compresslevel=3) if fmt == "txt.gz"
                  else open(path, "w", encoding="utf-8")) as f:
                f.write(text)
        files.append({"file": path.name, "documents": len(batch), "text_bytes": size, "bytes": path.stat().st_size})
        total, docs, k = total + size, docs + len(batch), k + 1
    made = {"recipe": recipe, "text_bytes": total, "documents": docs, "files": files}
    manifest.write_text(json.dumps(made, indent=1))
    return made


def _make(corpus: Path, bucket: str, cores: int) -> dict:
    """``dedloc data make``'s steps in a process of its own confined to ``cores`` of this machine's
    cores (``taskset``), a pool of as many processes: each step's time, and the peak memory of the
    process (the plan, the tokenizer's training, the card) and of the pool's (surveys, samples,
    pieces, partitions)."""
    code = f"""
import json, resource, time
from concurrent.futures import ProcessPoolExecutor
from dedloc_pipeline.dataset.build import Recipe, make
from dedloc_pipeline.dataset.sources import Source
from dedloc_pipeline.storage.bucket import Bucket
steps, t0 = {{}}, time.monotonic()
def progress(step, done, total):
    steps.setdefault(step, [time.monotonic(), None])[1] = time.monotonic()
with ProcessPoolExecutor({cores}) as pool:
    card = make(Bucket({bucket!r}), "big", Recipe(sources=(Source(url={str(corpus / "part-*")!r}),)), pool, progress)
wall = time.monotonic() - t0
print(json.dumps({{"wall_s": wall, "steps": {{k: b - a for k, (a, b) in steps.items()}},
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "pool_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "summary": card["sources"]["summary"], "train_pairs": card["splits"]["train"]["pairs"],
                  "shards": len(card["splits"]["train"]["shards"])}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:cores])
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(gb: float = 2.0) -> dict:
    """The corpus of ``gb`` GB on two cores; a tenth of it on one core and on two (two against
    one, and the memory against the corpus's size)."""
    import shutil
    import tempfile

    tenth = BIG.with_name(BIG.name + "-tenth")
    made = {BIG: write(BIG, gb), tenth: write(tenth, gb / 10, seed=1)}
    res: dict = {"corpus": {k: made[BIG][k] for k in ("text_bytes", "documents")}, "files": len(made[BIG]["files"]),
                 "tenth": {k: made[tenth][k] for k in ("text_bytes", "documents")}}
    runs = (("two cores", BIG, 2), ("a tenth, one core", tenth, 1), ("a tenth, two cores", tenth, 2))
    for tag, corpus, cores in runs:
        tmp = tempfile.mkdtemp(prefix="dedloc-corpus-")
        try:
            r = _make(corpus, f"file://{tmp}/bucket", cores)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        r["cores"] = cores
        r["text_mb"] = made[corpus]["text_bytes"] / 1e6
        r["mb_per_s"] = r["text_mb"] / r["wall_s"]
        r["mb_per_s_per_core"] = r["mb_per_s"] / cores
        res[tag] = r
    res["two_over_one"] = res["a tenth, one core"]["wall_s"] / res["a tenth, two cores"]["wall_s"]
    return res


def table(res: dict):
    from rich.table import Table

    t = Table(title=f"13. A data set from {res['corpus']['text_bytes'] / 1e9:.2f} GB of text "
                    f"({res['corpus']['documents']:,} documents, {res['files']} files), and a tenth of it: "
                    f"two cores {res['two_over_one']:.2f}x one")
    for col in ("run", "text MB", "wall s", "MB/s per core", "survey s", "sample s", "train s", "tokenize s",
                "pack s", "peak RSS MB: process", "pool"):
        t.add_column(col)
    for tag in ("two cores", "a tenth, one core", "a tenth, two cores"):
        r = res[tag]
        t.add_row(tag, f"{r['text_mb']:.0f}", f"{r['wall_s']:.0f}", f"{r['mb_per_s_per_core']:.2f}",
                  *[f"{r['steps'].get(s, 0):.0f}" for s in ("survey", "sample", "train", "tokenize", "pack")],
                  f"{r['peak_rss_mb']:.0f}", f"{r['pool_peak_rss_mb']:.0f}")
    return t


if __name__ == "__main__":
    made = write(BIG, float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
    print(f"{BIG}: {made['text_bytes'] / 1e9:.2f} GB of text, {made['documents']:,} documents "
          f"in {len(made['files'])} files")
