"""Bucket keys of one run. Every path the protocol touches is spelled here, and only here."""

from __future__ import annotations

LAYOUT_VERSION = 2  # 2: quantized codes stored zigzag-folded as uint8
PEER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # peer ids and shard parts: one key segment each


def _r(r: int) -> str:
    return f"{r:08d}"


class RunLayout:
    """Keys under ``runs/{run}/`` (see DESIGN.md, "Bucket layout")."""

    def __init__(self, run: str):
        self.run = run
        self.root = f"runs/{run}"

    # run-wide
    @property
    def config(self) -> str:
        return f"{self.root}/run.json"

    @property
    def roster(self) -> str:
        """The organizer-signed list of enrolled and revoked volunteer keys (identity.py)."""
        return f"{self.root}/ROSTER.json"

    @property
    def latest(self) -> str:
        return f"{self.root}/state/LATEST.json"

    @property
    def states(self) -> str:
        return f"{self.root}/state"

    # state r: what round r's gradients are computed against
    def state(self, r: int) -> str:
        return f"{self.root}/state/{_r(r)}"

    def params(self, r: int) -> str:
        return f"{self.state(r)}/params"

    def delta(self, r: int) -> str:
        """Compressed difference state r - state (r-1): what a synced peer downloads."""
        return f"{self.state(r)}/delta"

    def optim(self, r: int, name: str) -> str:
        return f"{self.state(r)}/optim/{name}"

    def applied(self, r: int, part: int) -> str:
        """Marker: the aggregator of chunk range ``part`` wrote its slice of state r."""
        return f"{self.state(r)}/applied/{part:05d}.json"

    def streams(self, r: int) -> str:
        """How far each peer's data stream is counted in states up to r: where a returning peer
        continues (manifests are pruned with their rounds; this is written with each commit)."""
        return f"{self.state(r)}/streams.json"

    def commit(self, r: int) -> str:
        return f"{self.state(r)}/COMMIT.json"

    # round r: gradients computed against state r
    def round(self, r: int) -> str:
        return f"{self.root}/rounds/{_r(r)}"

    def round_of(self, key: str) -> int:
        """The round of a key under ``rounds/`` (a manifest, a shard, a heartbeat)."""
        rest = key.removeprefix(f"{self.root}/rounds/")
        head = rest.split("/", 1)[0]
        if rest == key or not head.isdigit():
            raise ValueError(f"{key!r} is not a key of a round of run {self.run!r}")
        return int(head)

    def progress_dir(self, r: int) -> str:
        return f"{self.round(r)}/progress"

    def progress(self, r: int, peer: str) -> str:
        return f"{self.progress_dir(r)}/{peer}.json"

    def shards_dir(self, r: int) -> str:
        return f"{self.round(r)}/shards"

    def shard(self, r: int, peer: str, part: str) -> str:
        return f"{self.shards_dir(r)}/{peer}/{part}"

    def manifests_dir(self, r: int) -> str:
        """Manifests only, apart from the chunks: listing the round's shards lists just these."""
        return f"{self.round(r)}/manifests"

    def manifest(self, shard: str) -> str:
        """Marker of a shard, written after its chunks: ``rounds/R/manifests/PEER/PART.json``."""
        head, peer, part = shard.rsplit("/", 2)
        return f"{head.removesuffix('/shards')}/manifests/{peer}/{part}.json"

    def shard_of(self, manifest: str) -> str:
        head, peer, part = manifest.rsplit("/", 2)
        return f"{head.removesuffix('/manifests')}/shards/{peer}/{part.removesuffix('.json')}"

    def close(self, r: int) -> str:
        return f"{self.round(r)}/CLOSE.json"

    def reduced(self, r: int) -> str:
        """Scratch: the round's mean gradient, written range by range by the aggregators."""
        return f"{self.round(r)}/reduced/grad"

    def reduced_marker(self, r: int, part: int) -> str:
        return f"{self.round(r)}/reduced/{part:05d}.json"

    def stop(self) -> str:
        """Marker: the organizer ended the run; workers leave, schedulers commit what is closed and stop."""
        return f"{self.root}/STOP.json"

    def report(self) -> str:
        """The run's static HTML page (`dedloc report --upload`): one key the organizer can publish."""
        return f"{self.root}/report/index.html"

    def eval(self, r: int, task: str) -> str:
        return f"{self.root}/evals/{_r(r)}/{task}.json"

    def export(self, r: int) -> str:
        """State r as a Hugging Face model directory."""
        return f"{self.root}/export/{_r(r)}"

    def claim(self, block: int) -> str:
        """Marker: one peer streams this block of the data set (its number counts across epochs)."""
        return f"{self.root}/claims/{block:08d}.json"

    @property
    def claims_dir(self) -> str:
        return f"{self.root}/claims"


class DataLayout:
    """Keys under ``data/{name}/``: a tokenized data set, shared by every run that names it."""

    def __init__(self, name: str):
        self.root = f"data/{name}"

    @property
    def card(self) -> str:
        """Written last: a data set exists once its card does."""
        return f"{self.root}/DATA.json"

    @property
    def tokenizer(self) -> str:
        return f"{self.root}/tokenizer"

    def shard(self, split: str, i: int) -> str:
        return f"{self.root}/{split}/{i:05d}.npz"

    @property
    def unigram(self) -> str:
        """Token counts of the training split."""
        return f"{self.root}/unigram.npz"
