"""How Qwen3.5-MoE is cut: (TP/CP/EP/PP later) -> activation checkpointing -> FSDP per decoder layer,
with the MTP module as one more unit of its own."""

from __future__ import annotations

from torch import nn

from hyperpar.config import dtype_of
from hyperpar.distributed.activation_checkpoint import apply_activation_checkpoint
from hyperpar.distributed.data_parallel import apply_ac_and_dp
from hyperpar.distributed.fsdp import apply_fsdp


def parallelize_qwen3_5_moe(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    train = job_cfg.train
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return apply_ac_and_dp(model, model.model.layers, parallel_dims, train)
    # apply_ac_and_dp's order, with the MTP block checkpointed like a decoder layer and sharded as
    # the last unit (it runs after the main stack).
    apply_activation_checkpoint(model.model.layers, train.activation_checkpoint)
    apply_activation_checkpoint(mtp.layers, train.activation_checkpoint)
    mp = train.mixed_precision
    apply_fsdp(
        model,
        [*model.model.layers.values(), mtp],
        parallel_dims.fsdp_mesh(),
        param_dtype=dtype_of(mp.param_dtype),
        reduce_dtype=dtype_of(mp.reduce_dtype),
    )
    return model
