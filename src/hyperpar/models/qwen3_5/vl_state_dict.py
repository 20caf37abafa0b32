"""Qwen3.5 dense VL ↔ Hugging Face checkpoint keys (MODELS.md 2.4, 12).

The VL checkpoint is the text checkpoint under ``model.language_model.*`` plus ``model.visual.*``
(names one to one with ours). Every text parameter, ``lm_head.weight`` included, goes through the
text adapter, so its layout rules (fused GatedDeltaNet projections, tying) hold here unchanged;
this adapter only moves the ``model.`` ↔ ``model.language_model.`` prefix in both directions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import CheckpointError
from hyperpar.models.qwen3_5.args import Qwen3_5VLArgs
from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter, canonical_name
from hyperpar.models.vision.state_dict import export_vision_param, load_vision_param

_VL_TEXT = "model.language_model."
_TEXT = "model."
_VISUAL = "model.visual."


def _text_name(name: str) -> str | None:
    """Our VL parameter name as the text model names it, or None for a vision parameter."""
    if name.startswith(_VL_TEXT):
        return _TEXT + name[len(_VL_TEXT) :]
    if name == "lm_head.weight":
        return name
    return None


def _vl_key(text_key: str) -> str:
    """A text-layout checkpoint key in the VL layout (keys already there are left alone)."""
    if text_key.startswith((_VL_TEXT, _VISUAL)) or not text_key.startswith(_TEXT):
        return text_key
    return _VL_TEXT + text_key[len(_TEXT) :]


class Qwen3_5VLStateDictAdapter:
    def __init__(self, args: Qwen3_5VLArgs) -> None:
        self.args = args
        self.text = Qwen3_5StateDictAdapter(args.text)

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name = canonical_name(name)
        text_name = _text_name(name)
        if text_name is not None:
            return self.text.load_param(text_name, lambda key: read(_vl_key(key)))
        if name.startswith(_VISUAL):
            return load_vision_param(name, read)
        raise CheckpointError(f"qwen3_5_vl: parameter '{name}' has no checkpoint key")

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = canonical_name(name)
        text_name = _text_name(name)
        if text_name is not None:
            return {_vl_key(k): t for k, t in self.text.export_param(text_name, tensor).items()}
        if name.startswith(_VISUAL):
            return export_vision_param(name, tensor)
        raise CheckpointError(f"qwen3_5_vl: parameter '{name}' has no checkpoint key")

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
