"""The vision tower's parameters in and out of checkpoints (``model.visual.*``), for every VL adapter.

Names are the checkpoint's except the attention projections: ours are ``attn.q`` / ``attn.k`` /
``attn.v`` (weight and bias), the checkpoint's one fused ``attn.qkv`` with rows [q; k; v].
"""

from __future__ import annotations

from typing import Callable

import torch

from hyperpar.errors import MissingKeyError
from hyperpar.models.fused import FusedPart

_PARTS = {"q": 0, "k": 1, "v": 2}


def _split(name: str) -> tuple[str, int, str] | None:
    """(fused key, part index, leaf) when ``name`` is one of our split vision projections."""
    base, _, leaf = name.rpartition(".")  # leaf: weight | bias
    attn, _, part = base.rpartition(".")
    if attn.endswith(".attn") and part in _PARTS and leaf in ("weight", "bias"):
        return f"{attn}.qkv.{leaf}", _PARTS[part], leaf
    return None


def load_vision_param(name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Our ``model.visual.*`` parameter ``name``; ``read`` may return lazy or meta tensors."""
    split = _split(name)
    key = split[0] if split else name
    try:
        t = read(key)
    except KeyError:
        raise MissingKeyError(f"checkpoint has no tensor for '{name}' (key '{key}')") from None
    if split is None:
        return t
    rows = t.shape[0] // 3
    return t.narrow(0, split[1] * rows, rows)


def export_vision_param(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor | FusedPart]:
    split = _split(name)
    if split is None:
        return {name: tensor}
    return {split[0]: FusedPart(0, split[1], 3, tensor)}
