"""Parameters that a checkpoint stores concatenated in one tensor and the model keeps apart.

GatedDeltaNet's ``in_proj_qkv`` (rows [Q; K; V]) and its depthwise ``conv1d``, the experts'
``gate_up_proj`` ([gate; up]) are split into separate parameters in the module tree so tensor
parallelism can shard each part by heads (or by the intermediate dim) with a plain split. Import
narrows the fused tensor (a view, a meta tensor or a lazy slice: nothing more is read); export
returns a ``FusedPart`` per parameter, and ``join_parts`` concatenates them once all are there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from hyperpar.errors import CheckpointError


@dataclass(frozen=True)
class FusedPart:
    """Part ``index`` of ``count`` of the checkpoint tensor it is exported under, along ``dim``."""

    dim: int
    index: int
    count: int
    tensor: torch.Tensor


def join_parts(items: Iterable[tuple[str, torch.Tensor | FusedPart]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain tensors pass through; the parts of a fused key are concatenated (in part order) and
    yielded where its last part arrives. A key left incomplete is an error."""
    pending: dict[str, dict[int, FusedPart]] = {}
    for key, t in items:
        if not isinstance(t, FusedPart):
            yield key, t
            continue
        parts = pending.setdefault(key, {})
        parts[t.index] = t
        if len(parts) == t.count:
            del pending[key]
            ordered = [parts[i] for i in range(t.count)]
            yield key, torch.cat([_plain(p.tensor) for p in ordered], dim=t.dim)
    if pending:
        raise CheckpointError(f"export: fused tensors incomplete: {', '.join(sorted(pending)[:3])}")


def _plain(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor
    return (full_tensor() if full_tensor is not None else t).detach()

