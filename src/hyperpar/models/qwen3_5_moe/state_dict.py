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

from hyperpar.errors import CheckpointError
from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter, canonical_name, export_gdn_part, load_gdn_part
from hyperpar.models.qwen3_5_moe.args import Qwen3_5MoeArgs, Qwen3_5MoeVLArgs

_PACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter):
    args: Qwen3_5MoeArgs

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args)

    def hf_keys(self, name: str) -> list[str]:
        name = canonical_name(name)
        if name.startswith("mtp."):
            return [name]
        return super().hf_keys(name)

    def _expected_shape(self, name: str) -> tuple[int, int, int]:
        a = self.args
        E, H, Ie = a.num_experts, a.hidden_size, a.moe_intermediate_size
        return (E, 2 * Ie, H) if name.endswith("gate_up_proj") else (E, H, Ie)

    def _read_experts(self, name: str, key: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The packed tensor for checkpoint key ``key`` (packed, transposed-packed or per-expert)."""
        want = self._expected_shape(name)
        try:
            t = read(key)
        except KeyError:
            base = key.rsplit(".", 1)[0]  # …mlp.experts
            E = self.args.num_experts
            if key.endswith("gate_up_proj"):
                per = [torch.cat([read(f"{base}.{e}.gate_proj.weight"), read(f"{base}.{e}.up_proj.weight")], 0) for e in range(E)]
            else:
                per = [read(f"{base}.{e}.down_proj.weight") for e in range(E)]
            return torch.stack(per)
        if tuple(t.shape) != want and t.dim() == 3 and (t.shape[0], t.shape[2], t.shape[1]) == want:
            t = t.transpose(1, 2)  # legacy (E, in, out) packing
        return t.contiguous()

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        cname = canonical_name(name)
        if not cname.endswith(_PACKED):
            return super().load_param(cname, read)
        keys = self.hf_keys(cname)
        for key in keys:
            try:
                return self._read_experts(cname, key, read)
            except KeyError:
                continue
        raise CheckpointError(
            f"checkpoint has no tensor for '{cname}' (tried {', '.join(keys)}, packed and per-expert forms)"
        )

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = canonical_name(name)
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
        raise CheckpointError(f"qwen3_5_moe_vl: parameter '{name}' has no checkpoint key")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name = canonical_name(name)
        part = load_gdn_part(name, self.args.text, lambda fused: self.load_param(fused, read))
        if part is not None:
            return part
        keys = self.hf_keys(name)
        for key in keys:
            try:
                if name.endswith(_PACKED):
                    return self._text._read_experts(name, key, read)
                return read(key)
            except KeyError:
                continue
        raise CheckpointError(f"checkpoint has no tensor for '{name}' (tried {', '.join(keys)})")

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = canonical_name(name)
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return {}
        fused = export_gdn_part(name, tensor)
        if fused is not None:
            return fused
        self.hf_keys(name)  # rejects names that are not ours
        return {name: tensor}

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
