"""Qwen3-VL-MoE ↔ Hugging Face checkpoint keys and expert layouts (MODELS.md 12).

Our parameter names are transformers' ``Qwen3VLMoeForConditionalGeneration`` names, so keys map
one to one. What needs care are the packed experts (``models/experts_io.py``): the transformers 5.24 packing
(what we export), the released files' transposed packing and per-expert keys all load.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import MissingKeyError
from hyperpar.models.experts_io import expert_part, export_expert_part, read_expert_part
from hyperpar.models.vision.state_dict import export_vision_param, load_vision_param
from hyperpar.models.param_names import canonical_name
from hyperpar.models.qwen3_vl_moe.args import Qwen3VLMoeArgs

_PREFIXES = ("model.visual.", "model.language_model.")


class Qwen3VLMoeStateDictAdapter:
    def __init__(self, args: Qwen3VLMoeArgs) -> None:
        self.args = args

    def _check(self, name: str) -> None:
        if name != "lm_head.weight" and not name.startswith(_PREFIXES):
            raise MissingKeyError(f"qwen3_vl_moe: parameter '{name}' has no checkpoint key")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name = canonical_name(name)
        self._check(name)
        part = expert_part(name)
        if part is not None:
            t = self.args.text
            try:
                return read_expert_part(*part, read, E=t.num_experts, H=t.hidden_size, Ie=t.moe_intermediate_size)
            except KeyError:
                raise MissingKeyError(f"checkpoint has no tensor for '{name}' (packed or per expert)") from None
        if name.startswith("model.visual."):
            return load_vision_param(name, read)
        keys = [name]
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            # A tied checkpoint has no lm_head tensor; a pipeline stage holding only the head still
            # needs its copy of the embedding.
            keys.append("model.language_model.embed_tokens.weight")
        for key in keys:
            try:
                return read(key)
            except KeyError:
                continue
        raise MissingKeyError(f"checkpoint has no tensor for '{name}' (tried {', '.join(keys)})")

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = canonical_name(name)
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return {}
        self._check(name)
        part = expert_part(name)
        if part is not None:
            return export_expert_part(*part, tensor)
        if name.startswith("model.visual."):
            return export_vision_param(name, tensor)
        return {name: tensor}

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
