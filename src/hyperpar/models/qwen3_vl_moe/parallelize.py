"""How Qwen3-VL-MoE is cut: (TP/CP/EP/PP later) → activation checkpointing → FSDP per text decoder
layer and per vision block (the tower's embeddings and mergers stay in the root unit)."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.data_parallel import apply_ac_and_dp


def parallelize_qwen3_vl_moe(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    visual = model.model.visual
    extra = [visual.blocks] if visual is not None else []
    return apply_ac_and_dp(model, model.model.language_model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)
