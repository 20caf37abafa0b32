"""Activation checkpointing per block: ``full`` recomputes the whole block, ``selective`` keeps matmul
outputs and recomputes the cheap element-wise work.

Blocks receive shared inputs (rotary cos/sin) as arguments instead of calling a shared module, so
recomputation never touches state outside the block.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hyperpar.errors import ConfigError
from hyperpar.models.layers import moe, onednn_gemm  # noqa: F401  (register hyperpar's GEMM ops)

MODES = ("none", "full", "selective")

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.linalg_solve_triangular.default,
}
# Our own GEMM ops (fp32 linears on AMD CPUs, launch.cpu_gemm; the experts' loop) and torch's
# grouped GEMM (the experts) are dispatched as themselves, not as ``aten.mm``: left out, selective
# checkpointing recomputed every one of those GEMMs, as ``full`` does.
_SAVE_OPS.update({torch.ops.hyperpar.onednn_gemm.default, torch.ops.hyperpar.expert_loop_mm.default})
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)
# The attention kernels SDPA may pick on a GPU, and the varlen kernel of packed documents (an op of
# torch's own, ``torch_attn::_varlen_attn``, registered when its module is imported).
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)
try:
    import torch.nn.attention.varlen  # noqa: F401

    _SAVE_OPS.add(torch.ops.torch_attn._varlen_attn.default)
except (ImportError, AttributeError):  # an older torch: no varlen kernel to keep
    pass


# Profiler bookkeeping (``record_function`` enter/exit) is no computation, but it is dispatched:
# FSDP's hooks on a unit inside a block (the experts under ep) open a different number of
# ``record_function`` ranges in the forward and in the recompute, which selective checkpointing's
# per-op invocation count takes for a mismatch ("invocation index 3 ... not found in storage").
# torch's own set of ops the selective cache skips (``SAC_IGNORED_OPS``, public) gets them too.
torch.utils.checkpoint.SAC_IGNORED_OPS.update({
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
})


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
    raise ConfigError(f"train.activation_checkpoint='{mode}' is not one of {', '.join(MODES)}")


def apply_activation_checkpoint(layers: nn.ModuleDict, mode: str) -> None:
    """Replace each block in ``layers`` by its checkpointed wrapper (state-dict keys are unchanged)."""
    if mode not in MODES:
        raise ConfigError(f"train.activation_checkpoint='{mode}' is not one of {', '.join(MODES)}")
    if mode == "none":
        return
    for name, block in list(layers.items()):
        layers[name] = wrap_block(block, mode)
