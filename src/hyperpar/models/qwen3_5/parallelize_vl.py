"""How the VL models are cut (Qwen3.5 dense VL; reused by Qwen3.5-MoE VL and Qwen3-VL-MoE, whose trees
share these names): TP/SP of the text decoder (its embedding returns full embeddings so vision
features can be merged, then the stack's input is sequence-sharded), the vision tower replicated
(or TP'd with ``parallel.vision_tp``), DeepStack injection on whole sequences -> CP (the text
decoder's input cut to this rank's sequence shard after the vision merge, 3-D positions and
DeepStack masks; DeepStack and MTP on the shard) -> EP -> activation checkpointing -> FSDP per
text decoder layer and per vision block (the tower's embeddings and merger stay in the root unit
with the text embedding and head)."""

from __future__ import annotations

from torch import nn

from hyperpar.distributed.context_parallel import apply_context_parallel
from hyperpar.distributed.data_parallel import apply_ac_and_dp
from hyperpar.distributed.expert_parallel import apply_expert_parallel
from hyperpar.distributed.tensor_parallel import (
    FullSequence,
    ParallelStyle,
    Shard,
    ToSequenceShards,
    apply_tensor_parallel,
    lm_head_plan,
    mtp_plan,
    text_model_plan,
    use_loss_parallel,
    vision_tower_plan,
)


def vl_tp_plan(model: nn.Module, parallel_dims, train_cfg) -> dict[str, ParallelStyle]:
    tp, sp, kv = parallel_dims.tp, parallel_dims.sequence_parallel, parallel_dims.replicate_kv_heads
    lm = model.model.language_model
    plan = text_model_plan("model.language_model", lm, tp=tp, sp=sp, replicate_kv=kv, embed_to_stream=False)
    if sp:
        plan["model.language_model#input"] = ToSequenceShards()
        if getattr(lm, "deepstack", None) is not None:
            plan["model.language_model.deepstack"] = FullSequence(out_layout=Shard(1))
    if model.lm_head is not None:
        plan.update(lm_head_plan("lm_head", sp=sp, loss_parallel=use_loss_parallel(parallel_dims, train_cfg)))
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        plan.update(mtp_plan("mtp", mtp, tp=tp, sp=sp, replicate_kv=kv))
    visual = model.model.visual
    if visual is not None and parallel_dims.vision_tp:
        plan.update(vision_tower_plan("model.visual", visual))
    return plan


def parallelize_vl(model: nn.Module, parallel_dims, job_cfg) -> nn.Module:
    parallel_dims.check_supported()
    if parallel_dims.tp > 1:
        apply_tensor_parallel(model, parallel_dims, vl_tp_plan(model, parallel_dims, job_cfg.train))
    visual, mtp = model.model.visual, getattr(model, "mtp", None)
    apply_context_parallel(model, model.model.language_model, parallel_dims, mtp=mtp)
    apply_expert_parallel(model, parallel_dims)
    extra = ([visual.blocks] if visual is not None else []) + ([mtp.layers] if mtp is not None else [])
    return apply_ac_and_dp(model, model.model.language_model.layers, parallel_dims, job_cfg.train, extra_blocks=extra)


parallelize_qwen3_5_vl = parallelize_vl
