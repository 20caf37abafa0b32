"""``train.compile``: ``torch.compile`` per decoder block, the sequence kernels at its seams apart.

Each block (inside its activation-checkpoint wrapper, so recomputation runs the compiled code too)
is compiled in place (``module.compile()``: parameter names and checkpoint keys do not change).
The kernels at the model's seams stay out of the block's graph: the attention core and the gated
delta rule module (they read packed-document layouts whose lengths are Python values, which would
recompile per batch) and the MoE block (data-dependent expert counts, router statistics published
to the objective). What compiles with the block is the rest: norms, projections, gating, the
SwiGLU MLP, residual adds. The chunked delta rule itself (fixed shapes for a given sequence length;
document ids are values, not shapes) is compiled as a graph of its own, and so are the causal conv's
forward and backward for 16-bit tensors without packed documents (``GatedDeltaRule.compiled``).
Outside the model, the objective compiles the cross-entropy's per-row passes
(``train.cross_entropy``, ``Objective.compiled``).
Measured on dense_small (CPU, 2 threads): see docs/guide/performance.md.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from hyperpar.errors import PlanError

log = logging.getLogger("hyperpar")


def check_compile(parallel_dims, train_cfg) -> None:
    """The layouts ``train.compile`` is tested with: data parallel (single/DDP/FSDP/HSDP), tensor
    parallel (with and without SP), context parallel, expert parallel and pipeline parallel (gpipe,
    1f1b, interleaved_1f1b), AC none or full; each matched the eager single process per step
    (tests/test_compile.py). The kernels the cp and ep parallelizers wrap (attention core, delta rule,
    MoE block) run eager at the blocks' seams, and a pipeline stage runs the same compiled blocks as
    the whole model."""
    if not train_cfg.compile:
        return
    if parallel_dims.pp > 1:
        from hyperpar.plan import check_pp_schedule

        if check_pp_schedule(parallel_dims.pp_schedule) == "zero_bubble":
            raise PlanError("train.compile with pp_schedule=zero_bubble not supported (the schedule splits each "
                            "backward into input and weight gradients; a compiled block's backward is one piece)",
                            hint="use pp_schedule=1f1b, gpipe or interleaved_1f1b with train.compile=true")
    if train_cfg.activation_checkpoint == "selective":
        raise PlanError("train.compile with activation_checkpoint=selective not supported "
                        "(the save policy sees aten ops, compiled blocks run fused kernels)",
                        hint="use activation_checkpoint=full or none with train.compile=true")


def _eager_kernel_types() -> tuple[type, ...]:
    from hyperpar.models.layers.attention import AttentionCore
    from hyperpar.models.layers.gated_deltanet import GatedDeltaRule
    from hyperpar.models.layers.moe import SparseMoeBlock

    return AttentionCore, GatedDeltaRule, SparseMoeBlock


def _pending(x: object) -> bool:
    """A tensor (or a DTensor's local shard) that is still an in-flight functional collective."""
    if isinstance(x, DTensor):
        x = x._local_tensor
    return isinstance(x, AsyncCollectiveTensor)


@torch.compiler.disable
def _settle_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Run eager, ahead of the block's graph: an input still in flight is waited for (by a copy, which
    keeps the autograd edge). Tensor-parallel styles hand activations on asynchronously (the
    embedding's reduce-scatter under SP, its all-reduce without); a block compiled around such an
    input traced the wait into its graph and came back with a wrong input gradient (torch 2.13: the
    embedding's gradient 3e-2 relative off with SP, 2x without, the first norm's weight 1.1x)."""
    if not any(_pending(a) for a in (*args, *kwargs.values())):
        return None
    settle = lambda a: a.clone() if _pending(a) else a  # noqa: E731
    return tuple(settle(a) for a in args), {k: settle(v) for k, v in kwargs.items()}


def _per_rank_graphs() -> None:
    """Tensor-parallel graphs differ by rank where no cache key sees it: DTensor's shard offsets
    are constants AOTAutograd bakes in after its cache key is taken from the rank-independent Dynamo
    graph, so a rank could load another rank's compiled backward from the shared cache (measured,
    torch 2.13: grad norm 2.44 against 2.09). Every rank compiles its own."""
    import torch._functorch.config as functorch_config

    if functorch_config.enable_autograd_cache:
        functorch_config.enable_autograd_cache = False
        log.info("train.compile with tp: AOTAutograd's cache is off (its key does not see the rank)")


def compile_blocks(blocks: Iterable[nn.Module], tp: bool = False) -> int:
    """Compile every block in place, its kernels excluded; returns how many were compiled. ``tp``:
    the blocks run on DTensors (see ``_settle_inputs`` and ``_per_rank_graphs``)."""
    from hyperpar.models.layers.gated_deltanet import GatedDeltaRule

    if tp:
        _per_rank_graphs()
    kernels = _eager_kernel_types()
    n = 0
    for block in blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        for m in inner.modules():
            if isinstance(m, kernels):
                m.forward = torch.compiler.disable(m.forward)
            if isinstance(m, GatedDeltaRule):
                m.compiled = True
        if tp:
            inner.register_forward_pre_hook(_settle_inputs, with_kwargs=True)
        inner.compile()
        n += 1
    return n
