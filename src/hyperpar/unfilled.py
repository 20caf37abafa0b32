"""``torch.empty`` without the NaN fill of ``train.deterministic``.

``torch.use_deterministic_algorithms`` (``train.deterministic``) with
``train.fill_uninitialized_memory=true`` (off by default) fills every new tensor with NaN so that a
read of uninitialised memory shows: ~90 ms per 128 MB on one CPU thread. Buffers that are written
whole before anything reads them (FSDP's collective buffers, the cross-entropy's logits chunk and
gradient, the outputs of oneDNN's GEMMs) skip it even then, so the debugging run stays near the
speed of a normal one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


@contextlib.contextmanager
def unfilled() -> Iterator[None]:
    """No NaN fill of new tensors inside: for kernels that allocate their own output and write it
    whole (oneDNN's GEMM allocates its output with ``at::empty``, which the fill reaches)."""
    from torch.utils import deterministic

    fill = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = fill


def empty_unfilled(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(size)`` never NaN-filled; only for buffers written whole before any read."""
    with unfilled():
        return torch.empty(*size, dtype=dtype, device=device)
