"""Qwen3.5 dense ↔ Hugging Face checkpoint keys (MODELS.md 2.4, 12).

Our parameter names are transformers' ``Qwen3_5ForCausalLM`` names, so the adapter only maps
prefixes: imports read the text-only layout (``model.*``) or the VL layout
(``model.language_model.*``, ``model.visual.*`` / ``mtp.*`` ignored); exports write the
text-only layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hyperpar.errors import CheckpointError
from hyperpar.models.qwen3_5.args import Qwen3_5Args

# Wrapper segments that parallelisation may add to parameter names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


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
        raise CheckpointError(f"qwen3_5: parameter '{name}' has no checkpoint key")

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        keys = self.hf_keys(name)
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
        self.hf_keys(name)  # rejects names that are not ours
        return {name: tensor}

    def hf_config(self) -> dict[str, Any]:
        return self.args.to_hf_config()
