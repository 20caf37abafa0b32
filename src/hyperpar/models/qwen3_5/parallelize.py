"""How Qwen3.5 dense (and the Qwen3.5-MoE text model, which shares its tree) is cut:
TP/SP (heads of attention and GatedDeltaNet, MLP columns/rows, vocab-parallel embedding and head)
-> CP (the stack's residual stream and the MTP head sequence-sharded, Ulysses around the kernels)
-> EP -> activation checkpointing -> FSDP per decoder layer (over dp_shard x cp)."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.context_parallel import apply_context_parallel
from hyperpar.distributed.data_parallel import apply_ac_and_dp
from hyperpar.distributed.expert_parallel import apply_expert_parallel
from hyperpar.distributed.tensor_parallel import (
    ParallelStyle,
    apply_tensor_parallel,
    lm_head_plan,
    mtp_plan,
    text_model_plan,
    use_loss_parallel,
)


def causal_lm_tp_plan(model: nn.Module, parallel_dims, train_cfg) -> dict[str, ParallelStyle]:
    """``model.*`` text stack, ``lm_head`` and (when present) the ``mtp`` head."""
    tp, sp, kv = parallel_dims.tp, parallel_dims.sequence_parallel, parallel_dims.replicate_kv_heads
    plan = text_model_plan("model", model.model, tp=tp, sp=sp, replicate_kv=kv)
    if model.lm_head is not None:
        plan.update(lm_head_plan("lm_head", sp=sp, loss_parallel=use_loss_parallel(parallel_dims, train_cfg)))
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        plan.update(mtp_plan("mtp", mtp, tp=tp, sp=sp, replicate_kv=kv))
    return plan


def parallelize_qwen3_5(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    if parallel_dims.tp > 1:
        apply_tensor_parallel(model, parallel_dims, causal_lm_tp_plan(model, parallel_dims, job_cfg.train))
    mtp = getattr(model, "mtp", None)
    apply_context_parallel(model, model.model, parallel_dims, mtp=mtp)
    apply_expert_parallel(model, parallel_dims)
    extra = [mtp.layers] if mtp is not None else []
    return apply_ac_and_dp(model, model.model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)
