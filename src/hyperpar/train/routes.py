"""Where an MoE model's routers sent each step's tokens, as metrics that compare across layouts.

Per optimizer step, over the whole global batch (every micro-batch, rank and pipeline stage; tensor-
parallel replicas counted once; padding left out):

- ``route_hash``: a digest of the top-k assignments per (MoE block, expert). Two runs whose routers
  made the same choices log the same hash, whatever their layout.
- ``route_margin``: the smallest top-k margin ``p_k - p_{k+1}`` of any token, block and micro-batch.
  A token this close to a tie can go to another expert under another layout's rounding.
- ``route_max_load``: the busiest expert's assignments over the mean per expert, in the block where
  that ratio is largest: 1.0 is perfect balance, ``E / k`` one expert taking every token's slot.
- ``route_counts`` (``metrics.route_counts=true``): the assignments themselves, ``{block: [per
  expert]}``; what the parity report needs to tell a near-tied token that went the other way (one
  token moves, in the first block whose counts differ) from a layout that routes wrongly.

Costs two small all-reduces per step (blocks x experts fp32 numbers, and one) and a pass over the router
probabilities; dense models log none of it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyperpar.models.layers.moe import RouteRecord, SparseMoeBlock
from hyperpar.models.param_names import canonical_name


def _natural(key: str) -> list[Any]:
    # layers.10 after layers.9: the blocks in the order a forward meets them (mtp.* after model.*)
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def route_keys(parts: list[nn.Module]) -> dict[str, int]:
    """Name every MoE block of these model parts (``route_key``, its wrapper-free module name);
    returns {key: experts}."""
    keys: dict[str, int] = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, SparseMoeBlock):
                module.route_key = canonical_name(name)
                keys[module.route_key] = module.gate.num_experts
    return keys


class RouteMonitor:
    """The trainer's side of ``record_routes``: each step's record, reduced over the world."""

    def __init__(self, keys: list[str], experts: dict[str, int], tp: int, device: torch.device,
                 counts: bool = False) -> None:
        self.keys = keys  # every rank's blocks, in forward order
        self.sizes = [experts[k] for k in keys]  # each block's slice of the reduced vector
        self.tp = tp
        self.device = device
        self.counts = counts

    @classmethod
    def for_model(cls, parts: list[nn.Module], tp: int, device: torch.device, counts: bool = False) -> "RouteMonitor | None":
        """None for a model without MoE blocks on any rank. Collective when the world has more than
        one rank (pipeline stages hold different blocks): every rank must call it."""
        local = route_keys(parts)
        every = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, local)
        experts: dict[str, int] = {}
        for d in every:
            experts.update(d or {})
        if not experts:
            return None
        return cls(sorted(experts, key=_natural), experts, tp, device, counts)

    def summary(self, rec: RouteRecord) -> dict[str, Any]:
        """The step's metrics from this rank's record; collective (every rank calls it each step)."""
        # fp32, which every backend reduces (HCCL included): counts stay exact integers up to 2^24
        # assignments of one expert in one block per step, far above any global batch's
        vec = torch.zeros(sum(self.sizes), dtype=torch.float32, device=self.device)
        blocks = dict(zip(self.keys, vec.split(self.sizes)))  # views
        for key, c in rec.counts.items():
            blocks[key] += c.to(device=self.device, dtype=torch.float32)
        margin = torch.full((1,), float("inf"), dtype=torch.float32, device=self.device)
        if rec.margin is not None:
            margin[0] = rec.margin.float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
            dist.all_reduce(margin, op=dist.ReduceOp.MIN)
        # tensor-parallel ranks route the same (replicated) tokens: each choice is counted tp times
        counts = torch.round(vec / self.tp).to(torch.int64).cpu()
        out: dict[str, Any] = {"route_hash": hashlib.blake2b(counts.numpy().tobytes(), digest_size=8).hexdigest()}
        m = float(margin.item())
        out["route_margin"] = m if m != float("inf") else None
        per_block = counts.split(self.sizes)
        loads = [c.max().item() * c.numel() / c.sum().item() for c in per_block if c.sum().item() > 0]
        out["route_max_load"] = max(loads) if loads else None
        if self.counts:
            out["route_counts"] = {k: c.tolist() for k, c in zip(self.keys, per_block)}
        return out
