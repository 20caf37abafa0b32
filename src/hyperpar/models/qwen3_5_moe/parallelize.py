"""How Qwen3.5-MoE (text and VL) is cut: (TP/CP/EP/PP later) -> activation checkpointing -> FSDP per decoder layer;
the MTP decoder layer is checkpointed and sharded as a unit of its own (its fc and norms stay in
the root unit with the embedding and head)."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.data_parallel import apply_ac_and_dp


def parallelize_qwen3_5_moe(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    mtp = getattr(model, "mtp", None)
    extra = [mtp.layers] if mtp is not None else []
    return apply_ac_and_dp(model, model.model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)


def parallelize_qwen3_5_moe_vl(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    """The same per text layer, plus each vision block as a unit (the tower's embeddings and merger
    stay in the root unit)."""
    parallel_dims.check_supported()
    visual, mtp = model.model.visual, model.mtp
    extra = ([visual.blocks] if visual is not None else []) + ([mtp.layers] if mtp is not None else [])
    return apply_ac_and_dp(model, model.model.language_model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)
