"""Building blocks shared by the model families (norms, rotary, attention, GatedDeltaNet, MLP, MoE)."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.models.layers.attention import Attention, AttentionCore, attention_core
from hyperpar.models.layers.documents import Documents, mtp_stream_rows
from hyperpar.models.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaRule,
    causal_depthwise_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from hyperpar.models.layers.local import local
from hyperpar.models.layers.mlp import SwiGLUMLP
from hyperpar.models.layers.moe import (
    GroupedExperts,
    RouterStats,
    SparseMoeBlock,
    TopKRouter,
    experts_forward,
    load_balancing_loss,
    record_router_stats,
)
from hyperpar.models.layers.norms import GatedRMSNorm, RMSNorm
from hyperpar.models.layers.rope import RotaryEmbedding, apply_rotary
from hyperpar.models.param_names import WRAPPER_ATTRS

__all__ = [
    "Attention",
    "AttentionCore",
    "Documents",
    "GatedDeltaNet",
    "GatedDeltaRule",
    "GatedRMSNorm",
    "GroupedExperts",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterStats",
    "SparseMoeBlock",
    "SwiGLUMLP",
    "TopKRouter",
    "apply_rotary",
    "attention_core",
    "causal_depthwise_conv1d",
    "chunk_gated_delta_rule",
    "experts_forward",
    "init_param_by_module",
    "local",
    "load_balancing_loss",
    "mtp_stream_rows",
    "record_router_stats",
    "recurrent_gated_delta_rule",
]

# Wrappers that parallelisation may insert between a module and its children (DDP's ``module`` too);
# their extra name segment is skipped when resolving a parameter name to the module that owns it.
_WRAPPER_ATTRS = (*WRAPPER_ATTRS, "module")


def _owner(root: nn.Module, path: list[str]) -> nn.Module:
    module = root
    for part in path:
        child = module._modules.get(part)
        while child is None:
            inner = next((module._modules[a] for a in _WRAPPER_ATTRS if a in module._modules), None)
            if inner is None:
                raise KeyError(f"no module '{'.'.join(path)}' in {type(root).__name__}")
            module = inner
            child = module._modules.get(part)
        module = child
    return module


def init_param_by_module(
    root: nn.Module, name: str, full: torch.Tensor, gen: torch.Generator, *, std: float = 0.02
) -> None:
    """Fill ``full`` (the full-shaped fp32 CPU tensor of parameter ``name``) in place.

    Dispatches on the owning module's type, mirroring transformers' ``_init_weights``: Linear /
    Embedding / Conv weights ~ N(0, std), biases 0, norms (RMSNorm, LayerNorm) at their identity
    value, GatedDeltaNet's ``dt_bias`` = 1 and ``A_log`` = log U(0.01, 16). Embedding padding rows
    are zeroed.
    """
    *path, leaf = name.split(".")
    module = _owner(root, path)
    with torch.no_grad():
        if isinstance(module, (RMSNorm, GatedRMSNorm)):
            full.fill_(module.init_value())
        elif isinstance(module, nn.LayerNorm) and leaf == "weight":
            full.fill_(1.0)
        elif isinstance(module, GatedDeltaNet) and leaf == "dt_bias":
            full.fill_(1.0)
        elif isinstance(module, GatedDeltaNet) and leaf == "A_log":
            full.uniform_(0.01, 16.0, generator=gen).log_()
        elif isinstance(module, GroupedExperts) or (isinstance(module, TopKRouter) and leaf == "weight"):
            full.normal_(0.0, std, generator=gen)
        elif leaf == "bias":
            full.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv3d)) and leaf == "weight":
            full.normal_(0.0, std, generator=gen)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                full[module.padding_idx].zero_()
        else:
            raise KeyError(f"no init rule for parameter '{name}' ({type(module).__name__}.{leaf})")
