"""The flat vector the protocol exchanges, whatever the model.

The protocol sees a model as one float32 vector; ``FlatLayout`` maps it to named tensors in a
fixed (sorted) order, so every peer and aggregator cuts it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    size: int
    decay: bool  # weight decay applies (not to biases and LayerNorm)


class FlatLayout:
    """Named tensors <-> one flat float32 vector."""

    def __init__(self, model: torch.nn.Module):
        self.tensors: list[Tensor] = []
        offset = 0
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            decay = p.ndim > 1 and "LayerNorm" not in name and "norm" not in name.lower()
            self.tensors.append(Tensor(name, tuple(p.shape), offset, p.numel(), decay))
            offset += p.numel()
        self.n = offset
        self._params = dict(model.named_parameters())

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def pieces(self, lo: int, hi: int):
        """(tensor, start, stop) for every tensor overlapping [lo, hi), in flat coordinates."""
        for t in self.tensors:
            a, b = max(lo, t.offset), min(hi, t.offset + t.size)
            if a < b:
                yield t, a, b

    def get(self) -> np.ndarray:
        out = np.empty(self.n, np.float32)
        for t in self.tensors:
            out[t.offset:t.offset + t.size] = self._params[t.name].detach().reshape(-1).float().cpu().numpy()
        return out

    def set(self, flat: np.ndarray) -> None:
        with torch.no_grad():
            for t in self.tensors:
                src = torch.from_numpy(np.ascontiguousarray(flat[t.offset:t.offset + t.size]))
                self._params[t.name].copy_(src.view(t.shape))

    def grad(self) -> np.ndarray:
        out = np.zeros(self.n, np.float32)
        for t in self.tensors:
            g = self._params[t.name].grad
            if g is not None:
                out[t.offset:t.offset + t.size] = g.reshape(-1).float().cpu().numpy()
        return out
