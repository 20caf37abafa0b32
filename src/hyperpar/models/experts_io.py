"""Routed experts in and out of checkpoints (both MoE families).

Ours: ``…mlp.experts.gate_proj`` / ``up_proj`` (E, Ie, H) and ``down_proj`` (E, H, Ie). Import
accepts, for the checkpoint's ``…mlp.experts`` prefix:
- packed ``gate_up_proj`` (E, 2·Ie, H) rows [gate; up] and ``down_proj`` (E, H, Ie) (transformers 5.x
  and the released Qwen3.5-MoE files);
- the same transposed in dims 1 and 2 (released Qwen3-VL-MoE files), recognised by shape (when
  H = 2·Ie the shapes cannot tell and the stored tensor is taken as it is, as transformers does);
- per-expert keys ``experts.{e}.{gate_proj,up_proj,down_proj}.weight`` (stacked).
Export writes the packed form. Everything composes on lazy tensors: nothing is read until indexed.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyperpar.errors import CheckpointError
from hyperpar.models.fused import FusedPart
from hyperpar.models.lazy_tensor import stack_tensors

_PARTS = ("gate_proj", "up_proj", "down_proj")


def expert_part(name: str) -> tuple[str, str] | None:
    """(checkpoint prefix ``…mlp.experts``, part) when ``name`` is one of our expert parameters."""
    base, _, leaf = name.rpartition(".")
    if base.endswith("mlp.experts") and leaf in _PARTS:
        return base, leaf
    return None


def _oriented(t, want: tuple[int, int, int], key: str):
    if tuple(t.shape) == want:
        return t
    if t.dim() == 3 and (t.shape[0], t.shape[2], t.shape[1]) == want:
        return t.transpose(1, 2)
    raise CheckpointError(f"checkpoint tensor '{key}' has shape {tuple(t.shape)}, expected {want} or its (1, 2) transpose")


def read_expert_part(base: str, part: str, read: Callable[[str], torch.Tensor], *, E: int, H: int, Ie: int):
    """Our (E, Ie, H) gate/up or (E, H, Ie) down tensor from the checkpoint prefix ``base``; KeyError
    when the checkpoint has neither form there."""
    fused_key = f"{base}.gate_up_proj" if part != "down_proj" else f"{base}.down_proj"
    try:
        t = read(fused_key)
    except KeyError:
        # per-expert keys; a missing one raises KeyError (the caller may try another prefix)
        return stack_tensors([read(f"{base}.{e}.{part}.weight") for e in range(E)])
    if part == "down_proj":
        return _oriented(t, (E, H, Ie), fused_key)
    return _oriented(t, (E, 2 * Ie, H), fused_key).narrow(1, 0 if part == "gate_proj" else Ie, Ie)


def export_expert_part(base: str, part: str, tensor: torch.Tensor) -> dict[str, torch.Tensor | FusedPart]:
    if part == "down_proj":
        return {f"{base}.down_proj": tensor}
    return {f"{base}.gate_up_proj": FusedPart(1, 0 if part == "gate_proj" else 1, 2, tensor)}
