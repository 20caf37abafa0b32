"""How Qwen3.5 dense is cut: (TP/CP/PP later) -> activation checkpointing -> FSDP per decoder layer."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.data_parallel import apply_ac_and_dp


def parallelize_qwen3_5(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    return apply_ac_and_dp(model, model.model.layers, parallel_dims, job_cfg.train)
