"""A checkpoint tensor that is read only where it is indexed.

``HFCheckpoint.read_lazy(key)`` returns a ``LazyTensor``: shape and dtype from the safetensors
header, and ``t[index]`` reads just that box through ``safe_open(...).get_slice``. The adapters'
layout changes (``narrow`` for fused parts, ``transpose`` for legacy expert packings,
``stack_tensors`` for per-expert keys) compose without reading anything, so a tensor-parallel rank
loading a sharded parameter reads its shard and never the full tensor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Index = tuple[slice, ...]


def _norm(index: Index | slice | None, shape: Sequence[int]) -> Index:
    if index is None:
        index = ()
    if isinstance(index, slice):
        index = (index,)
    out = []
    for d, n in enumerate(shape):
        s = index[d] if d < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("LazyTensor slices must have step 1")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class LazyTensor:
    """``fetch(index)`` returns the tensor for a normalised box ``index`` of this view."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, fetch: Callable[[Index], torch.Tensor]) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._fetch = fetch

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def __getitem__(self, index: Index | slice) -> torch.Tensor:
        return self._fetch(_norm(index, self.shape))

    def materialize(self) -> torch.Tensor:
        return self[()]

    def contiguous(self) -> "LazyTensor":
        return self

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        dim = dim % self.ndim
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        shape = list(self.shape)
        shape[dim] = length

        def fetch(index: Index) -> torch.Tensor:
            s = index[dim]
            shifted = list(index)
            shifted[dim] = slice(s.start + start, s.stop + start)
            return self._fetch(tuple(shifted))

        return LazyTensor(shape, self.dtype, fetch)

    def transpose(self, a: int, b: int) -> "LazyTensor":
        a, b = a % self.ndim, b % self.ndim
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]

        def fetch(index: Index) -> torch.Tensor:
            swapped = list(index)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            return self._fetch(tuple(swapped)).transpose(a, b)

        return LazyTensor(shape, self.dtype, fetch)


def stack_tensors(items: Sequence[torch.Tensor | LazyTensor]) -> torch.Tensor | LazyTensor:
    """``torch.stack(items)`` on dim 0; lazy when any item is (then only indexed items are read)."""
    if not any(isinstance(t, LazyTensor) for t in items):
        return torch.stack(list(items))
    first = items[0]
    shape = (len(items), *first.shape)

    def fetch(index: Index) -> torch.Tensor:
        rows = index[0]
        inner = index[1:]
        parts = [t[inner] for t in items[rows]]
        if not parts:
            return torch.empty((0, *[s.stop - s.start for s in inner]), dtype=first.dtype)
        return torch.stack(parts)

    return LazyTensor(shape, first.dtype, fetch)


def read_box(t: torch.Tensor | LazyTensor, index: Index | None) -> torch.Tensor:
    """The box ``index`` (None: all) of a tensor or a lazy tensor, as a tensor."""
    if isinstance(t, LazyTensor):
        return t[index or ()]
    return t if index is None else t[index]
