"""The data-parallel + activation-checkpoint tail of every model's parallelize(): AC per block, compile
(``train.compile``), then FSDP."""

from __future__ import annotations

import logging
from typing import Sequence

from torch import nn

from hyperpar.config import dtype_of
from hyperpar.distributed.activation_checkpoint import apply_activation_checkpoint
from hyperpar.distributed.compile import check_compile, compile_blocks
from hyperpar.distributed.expert_parallel import expert_parallel_modules
from hyperpar.distributed.fsdp import apply_fsdp

log = logging.getLogger("hyperpar")


def apply_ac_and_dp(
    model: nn.Module,
    layers: nn.ModuleDict,
    parallel_dims,
    train_cfg,
    extra_blocks: Sequence[nn.ModuleDict] = (),
) -> nn.Module:
    """Checkpoint and shard every block of ``layers`` and of each ``extra_blocks`` container.

    ``extra_blocks`` are stacks that run *before* ``layers`` in the forward (e.g. vision blocks ahead
    of the text decoder): they become FSDP units of their own, and the last text layer stays the
    last unit, whose parameters are kept gathered between forward and backward.
    """
    groups = [*extra_blocks, layers]
    for group in groups:
        apply_activation_checkpoint(group, train_cfg.activation_checkpoint)
    if train_cfg.compile:
        check_compile(parallel_dims, train_cfg)
        n = compile_blocks(layers.values(), tp=parallel_dims.tp > 1)  # the text decoder's blocks (vision blocks stay eager)
        log.info("train.compile: %d decoder blocks compiled (attention core and MoE block eager, "
                 "the chunked delta rule a graph of its own)", n)
    mp = train_cfg.mixed_precision
    vocab_sharded: set = set()
    if parallel_dims.fsdp_vocab_parallel:
        from hyperpar.distributed import dp_vocab

        dp_vocab.check(parallel_dims, bool(train_cfg.fused_head_loss))
        if parallel_dims.fsdp_size > 1:
            # FSDP's own mesh: sharded over the data- and context-parallel ranks (each holding
            # different tokens), replicated over dp_replicate
            vocab_sharded = dp_vocab.shard_vocab(model, parallel_dims.fsdp_mesh(), dtype_of(mp.param_dtype))
            log.info("parallel.fsdp_vocab_parallel: the embedding and head sharded by vocabulary over %d FSDP "
                     "ranks (%d parameter(s) left out of FSDP)", parallel_dims.fsdp_size, len(vocab_sharded))
    experts = list(expert_parallel_modules(model)) if parallel_dims.ep > 1 else []
    apply_fsdp(
        model,
        [block for group in groups for block in group.values()],
        parallel_dims.fsdp_mesh(),
        param_dtype=dtype_of(mp.param_dtype),
        reduce_dtype=dtype_of(mp.reduce_dtype),
        expert_units=experts,
        expert_mesh=parallel_dims.expert_fsdp_mesh() if experts else None,
        reshard_after_forward=not parallel_dims.fsdp_units_kept,
        # a pipeline stage's schedule interleaves micro-batches' forwards and backwards, which the
        # one-rank casts (held from a forward to the end of its backward) do not follow
        one_rank_cast=bool(mp.one_rank_cast) and parallel_dims.pp == 1,
        ignored_params=vocab_sharded,
    )
    return model
