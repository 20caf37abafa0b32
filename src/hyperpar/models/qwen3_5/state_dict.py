"""Qwen3.5 dense ↔ Hugging Face checkpoint keys (MODELS.md 2.4, 12).

Our parameter names are transformers' ``Qwen3_5ForCausalLM`` names, so the adapter only maps
prefixes: imports read the text-only layout (``model.*``) or the VL layout
(``model.language_model.*``, ``model.visual.*`` / ``mtp.*`` ignored); exports write the
text-only layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import MissingKeyError
from hyperpar.models.fused import FusedPart
from hyperpar.models.param_names import canonical_name
from hyperpar.models.qwen3_5.args import Qwen3_5Args


# Our split GatedDeltaNet parameters -> (fused checkpoint name, part index); rows [Q; K; V].
_GDN_PARTS = {
    f"linear_attn.{ours}.weight": (f"linear_attn.{fused}.weight", i)
    for fused, names in (("in_proj_qkv", ("in_proj_q", "in_proj_k", "in_proj_v")), ("conv1d", ("conv1d_q", "conv1d_k", "conv1d_v")))
    for i, ours in enumerate(names)
}


def gdn_part(name: str) -> tuple[str, str, int] | None:
    """(our name's prefix, fused suffix, part index) when ``name`` is a split GatedDeltaNet weight."""
    for suffix, (fused, index) in _GDN_PARTS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], fused, index
    return None


def gdn_rows(args: Any, index: int) -> tuple[int, int]:
    """(offset, rows) of part ``index`` (Q, K, V) in the fused in_proj_qkv / conv1d; ``args`` is a
    text config with the linear-attention geometry."""
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = args.linear_num_value_heads * args.linear_value_head_dim
    return ((0, key_dim), (key_dim, key_dim), (2 * key_dim, value_dim))[index]


def load_gdn_part(name: str, args: Any, load: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """Our split GatedDeltaNet weight ``name`` as a narrowed view of ``load(fused name)``; None for
    any other parameter."""
    part = gdn_part(name)
    if part is None:
        return None
    prefix, fused, index = part
    return load(prefix + fused).narrow(0, *gdn_rows(args, index))


def export_gdn_part(name: str, tensor: torch.Tensor) -> dict[str, FusedPart] | None:
    part = gdn_part(name)
    if part is None:
        return None
    prefix, fused, index = part
    return {prefix + fused: FusedPart(0, index, 3, tensor)}


class Qwen3_5StateDictAdapter:
    def __init__(self, args: Qwen3_5Args) -> None:
        self.args = args

    def hf_keys(self, name: str) -> list[str]:
        """Candidate checkpoint keys for our parameter, in the order they are tried."""
        name = canonical_name(name)
        if name == "lm_head.weight":
            if self.args.tie_word_embeddings:
                # A tied checkpoint has no lm_head tensor; a pipeline stage holding only the head
                # still needs its copy of the embedding.
                return ["lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"]
            return ["lm_head.weight"]
        if name.startswith("model."):
            return [name, "model.language_model." + name[len("model.") :]]
        raise MissingKeyError(f"qwen3_5: parameter '{name}' has no checkpoint key")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """``read(key)`` may return a tensor, a meta tensor or a lazy slice: anything with ``narrow``."""
        name = canonical_name(name)
        part = load_gdn_part(name, self.args, lambda fused: self.load_param(fused, read))
        if part is not None:
            return part
        keys = self.hf_keys(name)
        for key in keys:
            try:
                return read(key)
            except KeyError:
                continue
        raise MissingKeyError(f"checkpoint has no tensor for '{name}' (tried {', '.join(keys)})")

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor | FusedPart]:
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
