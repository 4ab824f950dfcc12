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

    def shard(self, split: str, i: int) -> str:
        return f"{self.root}/{split}/{i:05d}.npz"

    @property
    def unigram(self) -> str:
        """Token counts of the training split."""
        return f"{self.root}/unigram.npz"
