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
Measured on dense_small (CPU, 2 threads): see docs/guide/performance.md.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hyperpar.errors import PlanError


def check_compile(parallel_dims, train_cfg) -> None:
    """The layouts ``train.compile`` is tested with: data parallel (single/DDP/FSDP/HSDP), context
    parallel, expert parallel and pipeline parallel (gpipe, 1f1b, interleaved_1f1b), AC none or full;
    each matched the eager single process per step (tests/test_compile.py). The kernels the cp and
    ep parallelizers wrap (attention core, delta rule, MoE block) run eager at the blocks' seams, and
    a pipeline stage runs the same compiled blocks as the whole model."""
    if not train_cfg.compile:
        return
    if parallel_dims.tp > 1:
        # Measured (torch 2.13, CPU): compiled tensor-parallel blocks gave the first block a wrong
        # input gradient (the embedding's gradient 2e-2 and the first norm weight's 4e-3 relative off
        # after one step; every other parameter exact). Compiling with dynamic=False crashed (SIGSEGV)
        # and with dynamic=True failed in inductor (RecursionError).
        raise PlanError("train.compile with tp not supported yet (compiled tensor-parallel blocks do not "
                        "reproduce the eager gradients)", hint="set train.compile=false or parallel.tp=1")
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


def compile_blocks(blocks: Iterable[nn.Module]) -> int:
    """Compile every block in place, its kernels excluded; returns how many were compiled."""
    from hyperpar.models.layers.gated_deltanet import GatedDeltaRule

    kernels = _eager_kernel_types()
    n = 0
    for block in blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        for m in inner.modules():
            if isinstance(m, kernels):
                m.forward = torch.compiler.disable(m.forward)
            if isinstance(m, GatedDeltaRule):
                m.compiled = True
        inner.compile()
        n += 1
    return n
