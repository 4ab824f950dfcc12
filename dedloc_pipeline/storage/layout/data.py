"""Keys under ``data/{name}/``: a tokenized data set."""

from __future__ import annotations


class DataLayout:
    """Keys under ``data/{name}/``: a tokenized data set, shared by every run that names it."""

    ROOT = "data"  # every data set's folder: what a volunteer may read besides its run

    def __init__(self, name: str):
        self.root = f"{self.ROOT}/{name}"

    @property
    def card(self) -> str:
        """Written last: a data set exists once its card does."""
        return f"{self.root}/DATA.json"

    @property
    def tokenizer(self) -> str:
        return f"{self.root}/tokenizer"

    def shard(self, recipe: str, split: str, partition: int, i: int = 0) -> str:
        """Shard ``i`` of one partition of a split, named by its recipe: a data set made again
        with another recipe never writes over the shards the card in place lists (a card lists
        its shards' keys: data sets made before partitions name theirs ``{split}/{i:05d}.npz``)."""
        return f"{self.root}/{split}/{recipe}-{partition:05d}-{i:04d}.npz"

    def splits(self) -> tuple[str, str]:
        """The folders holding a data set's shards."""
        return f"{self.root}/train", f"{self.root}/heldout"

    @property
    def unigram(self) -> str:
        """Token counts of the training split."""
        return f"{self.root}/unigram.npz"

    # the making of a data set (dataset/build.py): records of each step under one recipe's folder,
    # deleted once the card is written
    def work(self, recipe: str) -> str:
        return f"{self.root}/work/{recipe}"

    def job(self, recipe: str) -> str:
        """The recipe and the pieces listed at the start: a resumed run reads the same ones."""
        return f"{self.work(recipe)}/JOB.json"

    def survey(self, recipe: str, piece: int) -> str:
        return f"{self.work(recipe)}/survey/{piece:05d}.npz"

    def plan(self, recipe: str, piece: int | None = None) -> str:
        """A piece's decisions; without ``piece``, the summary (written after every piece's)."""
        return f"{self.work(recipe)}/plan/" + ("PLAN.json" if piece is None else f"{piece:05d}.npz")

    def sample(self, recipe: str, piece: int) -> str:
        return f"{self.work(recipe)}/sample/{piece:05d}.txt"

    def trained(self, recipe: str) -> str:
        """Written once the tokenizer is saved: its files' hashes."""
        return f"{self.work(recipe)}/TOKENIZER.json"

    def parts(self, recipe: str, partition: int) -> str:
        return f"{self.work(recipe)}/parts/{partition:05d}"

    def part(self, recipe: str, partition: int, piece: int, chunk: int) -> str:
        return f"{self.parts(recipe, partition)}/{piece:05d}-{chunk:04d}.npz"

    def tokenized(self, recipe: str, piece: int) -> str:
        """A piece's record, written after its parts: what it holds, and that it is done."""
        return f"{self.work(recipe)}/tokenized/{piece:05d}.json"

    def packed(self, recipe: str, partition: int) -> str:
        """A partition's record, written after its shards: their keys, sizes and hashes."""
        return f"{self.work(recipe)}/packed/{partition:05d}.json"

    def counts(self, recipe: str, partition: int) -> str:
        return f"{self.work(recipe)}/packed/{partition:05d}.npz"
