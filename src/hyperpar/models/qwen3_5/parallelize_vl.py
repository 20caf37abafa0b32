"""How the Qwen3.5 dense VL model is cut: (TP/CP/PP later) -> activation checkpointing -> FSDP per
text decoder layer and per vision block (the tower's embeddings and merger stay in the root unit
with the text embedding and head)."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.data_parallel import apply_ac_and_dp


def parallelize_qwen3_5_vl(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    visual = model.model.visual
    extra = [visual.blocks] if visual is not None else []
    return apply_ac_and_dp(model, model.model.language_model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)
