"""Data parallelism through FSDP2 (``fully_shard``) on a 2-D (replicate, shard) mesh.

One code path covers every DP layout: single (1x1), DDP (Nx1), FSDP (1xN) and HSDP (RxS). The
one-rank run is wrapped exactly like the N-rank run so its numerics (mixed-precision casts, the
reduce dtype, parameter leaves) are the same. The one exception is a one-rank mesh whose policy
casts nothing (parameters, compute and reduction all in the parameters' dtype): there FSDP would
only copy every parameter into its unsharded buffer (twice a step) and every gradient out of its
reduce buffer, exact copies, so the module stays plain (``one_rank_is_plain``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hyperpar.unfilled import unfilled


def mixed_precision_policy(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=None, cast_forward_inputs=True)


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    mesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    expert_units: Iterable[nn.Module] = (),
    expert_mesh=None,
    one_rank_cast: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard each block as its own unit, then the root (embeddings, final norm, head, tied weights).

    ``expert_units`` (expert-parallel experts, inside the blocks) are units of their own on
    ``expert_mesh`` (the data-parallel ranks left after ep), sharded before the blocks holding them.
    The model stays plain where ``one_rank_is_plain`` says FSDP would be copies only. With
    ``one_rank_cast`` (the caller's choice: one pipeline stage, ``train.mixed_precision.one_rank_cast``),
    a one-rank CPU mesh whose policy only casts gets ``OneRankCast`` instead of FSDP (see its module).
    ``ignored_params`` (the root's vocabulary-sharded weights, ``dp_vocab``) stay out of every unit."""
    if one_rank_is_plain(model, mesh, expert_mesh, param_dtype, reduce_dtype):
        return model
    blocks = list(blocks)
    if one_rank_cast and one_rank_casts_only(model, mesh, expert_mesh, param_dtype, reduce_dtype):
        from hyperpar.distributed.one_rank_cast import OneRankCast

        OneRankCast(model, blocks, param_dtype)
        return model
    _unshard_unfilled()
    mp = mixed_precision_policy(param_dtype, reduce_dtype)
    for unit in expert_units:
        fully_shard(unit, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for i, block in enumerate(blocks):
        # The last block's params are needed right away by backward; keeping them saves one all-gather.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    # The root (embeddings, final norm, head) is gathered from its pre-backward, the first of the
    # backward, to its post-backward, the last: resharding it after forward would only free it and
    # all-gather the largest unit again right away (FSDP's own default for a root).
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored_params or None)
    # Loss is a sum over the global batch divided by the global token count (see train/objective.py), so
    # gradients must be summed over data-parallel ranks, not averaged. On one rank FSDP's default is
    # that sum already, and a set factor (even 1.0) would cost a division pass over every gradient.
    if _one_rank(mesh, expert_mesh):
        return model
    for module in model.modules():
        if isinstance(module, FSDPModule):  # the setting is per FSDP unit
            module.set_gradient_divide_factor(1.0)
            # Gloo (CPU) has no PREMUL_SUM; plain SUM is also exact for a divide factor of 1.
            module.set_force_sum_reduction_for_comms(True)
    return model


def _unshard_unfilled() -> None:
    """FSDP's unshard and gradient reduction without the NaN fill (``train.fill_uninitialized_memory``) of new
    tensors. Under a 16-bit policy every unshard casts each fp32 shard into a fresh 16-bit tensor
    (the all-gather input; at one rank FSDP copies it into the unsharded parameter), and every
    reduction's copy-in (``chunk_cat`` of 16-bit gradients into the fp32 reduce buffer) goes through
    a fresh fp32 temporary; the fill would write each first. For dense_small's root unit (embedding
    and head) the copy-in's fills alone took 116 ms of a 2.2 s bf16 step in one profile (fresh pages).
    Everything these allocate is written whole before it is read (casts, the unsharded parameters'
    storage, the copy-in's result; its padding is zeros). Wraps three methods of FSDP's parameter
    group, once per process; after each reduction (raised or not) the group's reduce-scatter comm
    hears ``end_reduce()`` where it has one."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if getattr(FSDPParamGroup, "_hyperpar_unfilled", False):
        return
    for name in ("unshard", "wait_for_unshard", "post_backward"):
        method = getattr(FSDPParamGroup, name)

        def wrapped(self, *args, _method=method, _reduces=name == "post_backward", **kwargs):
            try:
                with unfilled():
                    return _method(self, *args, **kwargs)
            finally:
                # a reduction's buffer pairing (shm_collectives) never outlives it, even one that raised
                end = getattr(getattr(self, "_reduce_scatter_comm", None), "end_reduce", None) if _reduces else None
                if end is not None:
                    end()

        setattr(FSDPParamGroup, name, wrapped)
    FSDPParamGroup._hyperpar_unfilled = True


def _one_rank(mesh, expert_mesh) -> bool:
    """One data-parallel rank, expert parameters' mesh included."""
    return mesh.size() == 1 and (expert_mesh is None or expert_mesh.size() == 1)


def one_rank_is_plain(model: nn.Module, mesh, expert_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """FSDP would change nothing but the speed: one data-parallel rank (experts included), every
    parameter already in the compute and the reduce dtype (an fp32 run; a 16-bit policy keeps FSDP
    for its casts), and no tensor parallelism (FSDP's reduction also turns the partial gradients of
    TP-replicated parameters into whole ones). On dense_small fp32 the copies were ~0.13 s of a 4.2 s step."""
    from torch.distributed.tensor import DTensor

    return _one_rank(mesh, expert_mesh) and all(p.dtype == param_dtype == reduce_dtype and not isinstance(p, DTensor) for p in model.parameters())


def one_rank_casts_only(model: nn.Module, mesh, expert_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """One data-parallel CPU rank whose policy casts the parameters for compute and nothing else:
    every parameter plain (no tensor parallelism) and already in the reduce dtype."""
    from torch.distributed.tensor import DTensor

    return (_one_rank(mesh, expert_mesh) and mesh.device_type == "cpu" and param_dtype != reduce_dtype
            and all(p.dtype == reduce_dtype and not isinstance(p, DTensor) for p in model.parameters()))


def prime_unsharded_params(model: nn.Module) -> None:
    """Gather and free every FSDP unit once, after the weights are materialised.

    FSDP creates a unit's unsharded parameters at its first all-gather. A unit that has not run yet
    (the MTP head at ``mtp_loss_weight=0``, a vision tower before the first image) but whose
    gradient hook still fires at the end of a non-syncing micro-batch's backward (gradient
    accumulation under a mixed-precision policy) then fails with "'FSDPParam' object has no
    attribute '_unsharded_param'". One gather per unit at start-up makes every unit look like one
    that ran; the values are the sharded ones, nothing changes numerically.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()
