"""Qwen3.5-MoE ↔ Hugging Face checkpoint keys (MODELS.md 2.4, 11, 12).

Our names are transformers' ``Qwen3_5MoeForCausalLM`` names plus ``mtp.*``. Import accepts:
- the text layout (``model.*``) or the VL layout (``model.language_model.*``; ``model.visual.*``
  ignored, like transformers' CausalLM does);
- packed experts ``mlp.experts.gate_up_proj`` (E, 2·Ie, H) / ``down_proj`` (E, H, Ie) — the released
  format — or the per-expert keys ``mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` that
  transformers' ``save_pretrained`` writes (stacked, gate before up), or the legacy transposed
  packing (E, H, 2·Ie) / (E, Ie, H), recognised by shape when it differs from ours;
- ``mtp.*`` under the same rules (inference engines' names).
Export writes the text layout with packed experts and ``mtp.*`` (transformers skips ``mtp.*``).

The VL model's names are the VL checkpoint's (``model.language_model.*``, ``model.visual.*``,
``lm_head.weight``, ``mtp.*``): its adapter maps them one to one, with the same expert forms.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import MissingKeyError
from hyperpar.models.experts_io import expert_part, export_expert_part, read_expert_part
from hyperpar.models.fused import FusedPart
from hyperpar.models.vision.state_dict import export_vision_param, load_vision_param
from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter, canonical_name, export_gdn_part, load_gdn_part
from hyperpar.models.qwen3_5_moe.args import Qwen3_5MoeArgs, Qwen3_5MoeVLArgs


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    args: Qwen3_5MoeArgs

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args)

    def hf_keys(self, name: str) -> list[str]:
        name = canonical_name(name)
        if name.startswith("mtp."):
            return [name]
        return super().hf_keys(name)

    def load_experts(self, name: str, read: Callable[[str], torch.Tensor]):
        """Our expert parameter ``name`` from any of its checkpoint prefixes and forms, or None when
        ``name`` is not an expert parameter."""
        part = expert_part(name)
        if part is None:
            return None
        base, leaf = part
        a = self.args
        bases = [k.removesuffix(".down_proj") for k in self.hf_keys(base + ".down_proj")]
        for kb in bases:
            try:
                return read_expert_part(kb, leaf, read, E=a.num_experts, H=a.hidden_size, Ie=a.moe_intermediate_size)
            except KeyError:
                continue
        raise MissingKeyError(f"checkpoint has no tensor for '{name}' (tried {', '.join(bases)}: packed and per-expert forms)")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        cname = canonical_name(name)
        experts = self.load_experts(cname, read)
        return experts if experts is not None else super().load_param(cname, read)

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor | FusedPart]:
        name = canonical_name(name)
        part = expert_part(name)
        if part is not None:
            return export_expert_part(*part, tensor)
        if name.startswith("mtp."):
            return {name: tensor}
        return super().export_param(name, tensor)

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()


class Qwen3_5MoeVLStateDictAdapter:
    _PREFIXES = ("model.language_model.", "model.visual.", "mtp.")

    def __init__(self, args: Qwen3_5MoeVLArgs) -> None:
        self.args = args
        self._text = Qwen3_5MoeStateDictAdapter(args.text)  # the expert-layout rules

    def hf_keys(self, name: str) -> list[str]:
        name = canonical_name(name)
        if name == "lm_head.weight":
            tied = ["model.language_model.embed_tokens.weight"] if self.args.tie_word_embeddings else []
            return ["lm_head.weight", *tied]
        if name.startswith(self._PREFIXES):
            return [name]
        raise MissingKeyError(f"qwen3_5_moe_vl: parameter '{name}' has no checkpoint key")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name = canonical_name(name)
        part = load_gdn_part(name, self.args.text, lambda fused: self.load_param(fused, read))
        if part is not None:
            return part
        experts = self._text.load_experts(name, read)
        if experts is not None:
            return experts
        if name.startswith("model.visual."):
            return load_vision_param(name, read)
        keys = self.hf_keys(name)
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
        fused = export_gdn_part(name, tensor)
        if fused is not None:
            return fused
        part = expert_part(name)
        if part is not None:
            return export_expert_part(*part, tensor)
        if name.startswith("model.visual."):
            return export_vision_param(name, tensor)
        self.hf_keys(name)  # rejects names that are not ours
        return {name: tensor}

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
