"""Context parallelism, Ulysses style: the all-to-alls around the attention core and the
GatedDeltaNet recurrence (conv + delta rule).

Activations between kernels are sequence-sharded over ``cp`` (rank r holds positions
[r·S/cp, (r+1)·S/cp)). Heads are independent in both kernels, so around each one an all-to-all
turns (B, S/cp, heads, d) into (B, S, heads/cp, d): every rank runs the unchanged full-sequence
kernel on its heads (causal conv and chunked delta rule included, so no state crosses ranks),
and the reverse all-to-all restores the sequence shards. Packed documents (``Documents``) are
per token of the full row, so the kernels read the descriptor built from the full-row positions.

Query heads (GatedDeltaNet value heads) must divide by cp. K/V heads (GatedDeltaNet key heads)
fewer than that are repeated (``repeat_interleave``) until they divide: a query head keeps reading
the K/V head it reads without CP, each rank receives only the ones its query heads use, and the
cost is the repeated heads' share of the all-to-all (and of the kernel's K/V memory), e.g. 4 KV
heads under cp 8 send each K/V head twice. The GatedDeltaNet conv weights are repeated the same
way and sliced to the rank's heads, so their gradients sum over the repeats.

PyTorch has no Ulysses all-to-all, so this is ours, on the autograd-aware functional collective
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (its backward is the
reverse all-to-all).

Status: the kernel wrappers only. Sharding the model inputs (after the VL merge, 3-D positions
and DeepStack masks), the labels and the loss's token counts is not wired yet, so
``parallel.cp`` stays refused by ``ParallelDims``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from hyperpar.models.layers.attention import AttentionCore
from hyperpar.models.layers.gated_deltanet import GatedDeltaRule


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all over dim 0 (chunk j goes to rank j, chunk i received from rank i)."""
    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(B, S/cp, H, d) sequence shard -> (B, S, H/cp, d): the full sequence of this rank's heads."""
    B, s, H, d = x.shape
    chunks = x.view(B, s, cp, H // cp, d).permute(2, 0, 1, 3, 4)  # (cp: head group, B, s, H/cp, d)
    got = _a2a(chunks, group)  # (cp: source rank = sequence chunk, B, s, H/cp, d)
    return got.permute(1, 0, 2, 3, 4).reshape(B, cp * s, H // cp, d)


def heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(B, S, H/cp, d) -> (B, S/cp, H, d): the inverse of ``seq_to_heads``."""
    B, S, h, d = x.shape
    chunks = x.view(B, cp, S // cp, h, d).permute(1, 0, 2, 3, 4)  # (cp: sequence chunk, B, s, h, d)
    got = _a2a(chunks, group)  # (cp: source rank = head group, B, s, h, d)
    return got.permute(1, 2, 0, 3, 4).reshape(B, S // cp, cp * h, d)


def head_repeats(heads: int, cp: int) -> int:
    """How many times each of ``heads`` K/V (key) heads is repeated so the count divides cp."""
    return cp // math.gcd(heads, cp)


def check_heads(what: str, heads: int, cp: int) -> None:
    if heads % cp:
        raise ValueError(f"{heads} {what} (on this rank) cannot be split over cp {cp}")


class UlyssesAttention:
    """Hooks on one ``AttentionCore``: q/k/v to head-sharded full sequences before, back after."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.cp, self.group = mesh.size(), mesh.get_group()

    def apply(self, module: AttentionCore) -> AttentionCore:
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)
        return module

    def _before(self, module: nn.Module, args: tuple) -> tuple:
        q, k, v = args[:3]
        cp = self.cp
        check_heads("query heads", q.shape[2], cp)
        rep = head_repeats(k.shape[2], cp)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return (seq_to_heads(q, cp, self.group), seq_to_heads(k, cp, self.group), seq_to_heads(v, cp, self.group),
                *args[3:])

    def _after(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return heads_to_seq(out, self.cp, self.group)


class UlyssesDeltaRule:
    """Hooks on one ``GatedDeltaRule``: q, k, v, g, beta to head-sharded full sequences (the conv
    weights to this rank's heads) before, the output back to sequence shards after."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.cp, self.rank, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group()

    def apply(self, module: GatedDeltaRule) -> GatedDeltaRule:
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)
        return module

    def _heads_of_rank(self, w: torch.Tensor, heads: int, rep: int) -> torch.Tensor:
        """Depthwise conv weight (heads·d, K), head-major channels: repeated like its heads, then
        the rank's block of heads."""
        d = w.shape[0] // heads
        blocks = w.view(heads, d, -1)
        if rep > 1:
            blocks = blocks.repeat_interleave(rep, dim=0)
        per_rank = blocks.shape[0] // self.cp
        return blocks[self.rank * per_rank:(self.rank + 1) * per_rank].reshape(per_rank * d, -1)

    def _before(self, module: nn.Module, args: tuple) -> tuple:
        q, k, v, g, beta, conv_q, conv_k, conv_v = args[:8]
        cp, group = self.cp, self.group
        nk, nv = k.shape[2], v.shape[2]
        check_heads("linear-attention value heads", nv, cp)
        rep = head_repeats(nk, cp)
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return (
            seq_to_heads(q, cp, group), seq_to_heads(k, cp, group), seq_to_heads(v, cp, group),
            seq_to_heads(g.unsqueeze(-1), cp, group).squeeze(-1), seq_to_heads(beta.unsqueeze(-1), cp, group).squeeze(-1),
            self._heads_of_rank(conv_q, nk, rep), self._heads_of_rank(conv_k, nk, rep), self._heads_of_rank(conv_v, nv, 1),
            *args[8:],
        )

    def _after(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return heads_to_seq(out, self.cp, self.group)


def apply_ulysses(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Wrap every attention core and GatedDeltaNet recurrence of ``model`` for the cp mesh."""
    for module in model.modules():
        if isinstance(module, AttentionCore):
            UlyssesAttention(cp_mesh).apply(module)
        elif isinstance(module, GatedDeltaRule):
            UlyssesDeltaRule(cp_mesh).apply(module)
    return model
