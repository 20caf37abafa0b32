"""Expert parallelism: the routed experts of every MoE block split over the ``ep`` mesh.

Each rank keeps ``E / ep`` whole experts (``Shard(0)`` of the packed (E, ·, ·) parameters) and the
router, combine and shared expert stay local (routing happens before dispatch, so router
statistics and the aux loss are exactly what one process computes on these tokens).

``GroupedExperts.forward(x_sorted, counts)`` already receives rows sorted by global expert with a
row count per expert, so EP only wraps that call, with forward hooks:

1. dispatch: per-expert counts are exchanged first (an all-to-all of E integers), then the rows
   go to the rank owning their expert (all-to-all with those split sizes). They arrive grouped by
   source rank, then local expert; a permutation regroups them by local expert for the grouped GEMM.
2. the local experts run on their rows (no capacity, no padding: no token is dropped).
3. combine: the inverse permutation, then the reverse all-to-all hands every row back in the
   caller's order; the routing weights and the k-slot sum happen in ``routed_experts`` as before.

PyTorch has no MoE token dispatch, so this is ours, on the autograd-aware functional collective
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (its backward is the
reverse all-to-all).

With tensor parallelism the experts are also TP-sharded inside each EP group: ``ExpertTensorParallel``
(applied first) splits every expert's intermediate dim over ``tp`` and all-reduces the partial
outputs; the tokens are replicated over tp, so the tp ranks of one EP group dispatch the same rows
to the same experts. The parameters become 2-D DTensors on the (ep, tp) mesh, [Shard(0), Shard(k)].
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hyperpar.models.layers.moe import GroupedExperts, permute_rows

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


def _shard_experts(module: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """Each parameter becomes this rank's ``E / ep`` experts: a DTensor on ``ep`` (Shard(0)), or on
    (ep, tp) when tensor parallelism already sharded it on the tp mesh."""
    ep, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_PARAMS:
        p = getattr(module, name)
        if isinstance(p, DTensor):
            mesh = DeviceMesh._concatenate([ep_mesh, p.device_mesh])
            placements = (Shard(0), *p.placements)
            whole = p.to_local()
        else:
            mesh, placements, whole = ep_mesh, (Shard(0),), p.data
        n = p.shape[0] // ep
        shard = whole.narrow(0, r * n, n)
        dt = DTensor.from_local(shard, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
        module.register_parameter(name, nn.Parameter(dt, p.requires_grad))
    module.local_experts = module.num_experts // ep


class _Route:
    """What the dispatch of one forward call told the combine."""

    def __init__(self, send: list[int], recv: list[int], order: torch.Tensor, inv: torch.Tensor) -> None:
        self.send, self.recv, self.order, self.inv = send, recv, order, inv


def _regroup(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive as (source rank, local expert) blocks with sizes ``recv_counts`` (ep, El); the
    permutation ``order`` lists them as (local expert, source rank) blocks; ``inv`` undoes it."""
    ep, El = recv_counts.shape
    sizes = recv_counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # start of block (s, e) in arrival order
    by_expert = recv_counts.t().reshape(-1)  # block sizes in (e, s) order
    block_start = starts.view(ep, El).t().reshape(-1)
    total = int(sizes.sum())
    # row j of block b (in (e, s) order) is arrival row block_start[b] + j
    offsets = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(by_expert.numel(), device=sizes.device), by_expert)
    order = block_start[block] + (torch.arange(total, device=sizes.device) - offsets[block])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(total, device=order.device)
    return order, inv


class ExpertParallel:
    """Hooks on one ``GroupedExperts`` module: dispatch before its forward, combine after."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self._routes: list[_Route] = []

    def apply(self, module: GroupedExperts) -> GroupedExperts:
        if module.num_experts % self.mesh.size():
            raise ValueError(f"{module.num_experts} experts cannot be split over ep {self.mesh.size()}")
        _shard_experts(module, self.mesh)
        # Hooks run in registration order, after tensor parallelism's: its input hook (identity
        # forward, gradient all-reduce over tp) sees the rows before dispatch, which commutes with
        # the dispatch since every tp rank sends the same rows; its output all-reduce runs on the
        # local experts' rows before they are sent back.
        module.register_forward_pre_hook(self._dispatch)
        module.register_forward_hook(self._combine)
        return module

    def _dispatch(self, module: GroupedExperts, inputs: tuple) -> tuple:
        x, counts = inputs[0], inputs[1]
        ep, El = self.mesh.size(), module.local_experts
        # 1. counts first: recv[s, e] = rows source rank s sends to my local expert e
        recv = all_to_all_single(counts.to(torch.int64).contiguous(), None, None, self.group).view(ep, El)
        send_sizes = counts.view(ep, El).sum(1).tolist()  # the host syncs of the dispatch
        recv_sizes = recv.sum(1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), recv_sizes, send_sizes, self.group)
        order, inv = _regroup(recv)
        self._routes.append(_Route(send_sizes, recv_sizes, order, inv))
        return (permute_rows(rows, order, inv), recv.sum(0))

    def _combine(self, module: GroupedExperts, inputs: tuple, y: torch.Tensor) -> torch.Tensor:
        route = self._routes.pop()
        y = permute_rows(y, route.inv, route.order)
        return all_to_all_single_autograd(y.contiguous(), route.send, route.recv, self.group)


def apply_expert_parallel(model: nn.Module, parallel_dims) -> nn.Module:
    """Split the routed experts of every MoE block over ``parallel_dims``' ep mesh (after TP).

    ``model`` may be one pipeline stage, which can hold no MoE block at all (Qwen3-VL-MoE's
    ``mlp_only_layers``): it then has nothing to split. A model with no routed experts anywhere is
    refused by the plan (ParallelDims.check_geometry)."""
    if parallel_dims.ep == 1:
        return model
    mesh = parallel_dims.ep_mesh()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            ExpertParallel(mesh).apply(module)
    return model


def expert_parallel_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The expert modules EP split (each becomes an FSDP unit on the expert mesh)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts) and getattr(module, "local_experts", None) is not None:
            yield module
