"""Qwen3-VL-MoE ↔ Hugging Face checkpoint keys and expert layouts (MODELS.md 12).

Our parameter names are transformers' ``Qwen3VLMoeForConditionalGeneration`` names, so keys map
one to one. What needs care are the packed experts:

- transformers 5.24 (in memory and ``save_pretrained``): ``gate_up_proj`` (E, 2·Ie, H) with rows
  [gate; up], ``down_proj`` (E, H, Ie) — our layout, and what we export;
- the released Qwen3-VL-MoE files: ``gate_up_proj`` (E, H, 2·Ie), ``down_proj`` (E, Ie, H) — the
  transpose of dims 1 and 2, recognised by shape on import (when H = 2·Ie the shapes cannot tell
  the layouts apart and the stored tensor is taken as it is, as transformers does);
- per-expert keys ``experts.{e}.{gate_proj,up_proj,down_proj}.weight`` are stacked on import.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import CheckpointError
from hyperpar.models.qwen3_vl_moe.args import Qwen3VLMoeArgs

# Wrapper segments that parallelisation may add to parameter names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_PREFIXES = ("model.visual.", "model.language_model.")


def canonical_name(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


class Qwen3VLMoeStateDictAdapter:
    def __init__(self, args: Qwen3VLMoeArgs) -> None:
        self.args = args

    def _check(self, name: str) -> None:
        if name != "lm_head.weight" and not name.startswith(_PREFIXES):
            raise CheckpointError(f"qwen3_vl_moe: parameter '{name}' has no checkpoint key")

    def _expected_expert_shape(self, name: str) -> tuple[int, int, int]:
        t = self.args.text
        E, H, Ie = t.num_experts, t.hidden_size, t.moe_intermediate_size
        return (E, 2 * Ie, H) if name.endswith("gate_up_proj") else (E, H, Ie)

    def _read_experts(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        expected = self._expected_expert_shape(name)
        try:
            t = read(name)
        except KeyError:
            return self._stack_experts(name, read)
        if tuple(t.shape) == expected:
            return t
        if t.dim() == 3 and (t.shape[0], t.shape[2], t.shape[1]) == expected:
            return t.transpose(1, 2).contiguous() if t.device.type != "meta" else t.transpose(1, 2)
        raise CheckpointError(f"checkpoint tensor '{name}' has shape {tuple(t.shape)}, expected {expected} or its (1, 2) transpose")

    def _stack_experts(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Per-expert checkpoint keys → one packed tensor (gate rows before up rows)."""
        base = name.rsplit(".", 1)[0]  # ...mlp.experts
        E = self.args.text.num_experts
        try:
            if name.endswith("gate_up_proj"):
                rows = [torch.cat([read(f"{base}.{e}.gate_proj.weight"), read(f"{base}.{e}.up_proj.weight")]) for e in range(E)]
            else:
                rows = [read(f"{base}.{e}.down_proj.weight") for e in range(E)]
        except KeyError:
            raise CheckpointError(f"checkpoint has no tensor for '{name}' (packed or per expert)") from None
        return torch.stack(rows)

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        name = canonical_name(name)
        self._check(name)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return self._read_experts(name, read)
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
        raise CheckpointError(f"checkpoint has no tensor for '{name}' (tried {', '.join(keys)})")

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = canonical_name(name)
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return {}
        self._check(name)
        return {name: tensor}

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
