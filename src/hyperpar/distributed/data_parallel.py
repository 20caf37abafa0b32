"""The data-parallel + activation-checkpoint tail of every model's parallelize(): AC per block, then FSDP."""

from __future__ import annotations

from torch import nn

from hyperpar.config import dtype_of
from hyperpar.distributed.activation_checkpoint import apply_activation_checkpoint
from hyperpar.distributed.fsdp import apply_fsdp


def apply_ac_and_dp(model: nn.Module, layers: nn.ModuleDict, parallel_dims, train_cfg) -> nn.Module:
    apply_activation_checkpoint(layers, train_cfg.activation_checkpoint)
    mp = train_cfg.mixed_precision
    apply_fsdp(
        model,
        layers.values(),
        parallel_dims.fsdp_mesh(),
        param_dtype=dtype_of(mp.param_dtype),
        reduce_dtype=dtype_of(mp.reduce_dtype),
    )
    return model
