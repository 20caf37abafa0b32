"""Context parallelism, Ulysses style: the all-to-alls around the attention core and the
GatedDeltaNet recurrence (conv + delta rule).

Activations between kernels are sequence-sharded over ``cp`` (rank r holds positions
[r·S/cp, (r+1)·S/cp)). Heads are independent in both kernels, so around each one an all-to-all
turns (B, S/cp, heads, d) into (B, S, heads/cp, d): every rank runs the unchanged full-sequence
kernel on its heads (causal conv and chunked delta rule included, so no state crosses ranks),
and the reverse all-to-all restores the sequence shards. Packed documents (``Documents``) are
per token of the full row, so the kernels read the descriptor built from the full-row positions.

K/V heads (GatedDeltaNet key heads) cp does not divide are repeated (``repeat_interleave``) until
they do: a query head keeps reading the K/V head it reads without CP, each rank receives only the
ones its query heads use, and the cost is the repeated heads' share of the all-to-all (and of the
kernel's K/V memory), e.g. 4 KV heads under cp 8 send each K/V head twice. The GatedDeltaNet conv
weights are repeated the same way and sliced to the rank's heads, so their gradients sum over the
repeats.

Query heads (GatedDeltaNet value heads) cp does not divide, e.g. 4 heads under cp 8 or 3 under
cp 2, are padded with empty heads to the next multiple of cp (``padded_heads``): every query head
first gets its own K/V head (the K/V heads repeated to the query heads' count, since a rank's query
heads no longer read a whole group), then q, k, v (and g, beta, the conv weights' rows) get zero
heads appended, the kernels run on ceil(heads / cp) heads a rank, and the padded heads' outputs are
dropped after the reverse all-to-all. A zero head is exact: nothing reads its output, so no
gradient reaches it, and nothing in it is non-finite to leak through a zero gradient (zero queries
and keys give uniform attention over zero values; the delta rule's l2norm has its eps and its decay
is 1). The cost is the padded share of the all-to-alls and of the kernels, e.g. 3 heads under cp 2
run 4; the plan prints it.

PyTorch has no Ulysses all-to-all, so this is ours, on the autograd-aware functional collective
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (its backward is the
reverse all-to-all); router statistics are summed with the same module's ``all_reduce`` (whose
backward all-reduces the gradient).

Around the kernels (``apply_context_parallel``, hooks only, the model files untouched):

- the text model's input (token ids, or a VL model's merged embeddings) is cut to this rank's
  shard on entry, *after* everything that needs the whole row ran on it (vision merge, 3-D
  positions, DeepStack masks); the positions stay whole, so the model builds its rotary tables and
  its ``Documents`` from the full row, and each decoder layer gets its shard of cos/sin and of the
  token mask;
- DeepStack adds the features of the visual tokens inside the shard (mask and feature rows cut);
- the MTP head runs sequence-sharded too: rank r's stream rows read the embedding of the token one
  past its shard (the inputs are whole rows), the last rank pads one masked row so every shard is
  the same length for the all-to-all, and drops it again after;
- ``SequenceShard`` cuts the labels the same way for the objective, which counts each shard's
  tokens once and sums the router statistics over cp before forming the load-balancing loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_reduce, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from hyperpar.models.layers.attention import AttentionCore
from hyperpar.models.layers.documents import Documents
from hyperpar.models.layers.gated_deltanet import GatedDeltaRule
from hyperpar.models.layers.moe import RouterStats


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


def padded_heads(heads: int, cp: int) -> int:
    """Query (GatedDeltaNet value) heads rounded up to a multiple of cp: the count the kernels run on
    over all cp ranks, the extra ones empty."""
    return -(-heads // cp) * cp


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Append zero heads on dim 2 of (B, S, H[, d]) up to ``heads``."""
    extra = heads - x.shape[2]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:2], extra, *x.shape[3:])], dim=2)


def _read_repeats(heads: int, read: int, cp: int) -> int:
    """How many times each of the ``read`` K/V (key) heads is repeated for ``heads`` query (value)
    heads: as far as cp needs when it divides the query heads, else to one per query head (their
    padded split no longer keeps whole groups on a rank)."""
    return heads // read if heads % cp else head_repeats(read, cp)


def head_padding(geometry: dict[str, int], tp: int, cp: int) -> str:
    """What the plan prints when cp pads a kernel's heads: '' when every count divides."""
    parts = []
    for key, what in (("num_attention_heads", "attention heads"), ("linear_num_value_heads", "linear-attention value heads")):
        n = geometry.get(key, 0)
        local = n // tp
        if not n or n % tp or padded_heads(local, cp) == local:  # absent, refused by tp's check, or unpadded
            continue
        per = f" ({local} per tp rank)" if tp > 1 else ""
        parts.append(f"{what} {n}{per} padded to {padded_heads(local, cp)} for cp {cp}")
    if not parts:
        return ""
    return "; ".join(parts) + " (the empty heads cost kernel and all-to-all time; their output is dropped)"


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
        cp, heads = self.cp, q.shape[2]
        self.heads = heads  # the forward hook sees only the padded output
        rep, total = _read_repeats(heads, k.shape[2], cp), padded_heads(heads, cp)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        if total != heads:
            q, k, v = (_pad_heads(t, total) for t in (q, k, v))
        return (seq_to_heads(q, cp, self.group), seq_to_heads(k, cp, self.group), seq_to_heads(v, cp, self.group),
                *args[3:])

    def _after(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = heads_to_seq(out, self.cp, self.group)
        return out if out.shape[2] == self.heads else out[:, :, :self.heads]


class UlyssesDeltaRule:
    """Hooks on one ``GatedDeltaRule``: q, k, v, g, beta to head-sharded full sequences (the conv
    weights to this rank's heads) before, the output back to sequence shards after."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.cp, self.rank, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group()

    def apply(self, module: GatedDeltaRule) -> GatedDeltaRule:
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)
        return module

    def _heads_of_rank(self, w: torch.Tensor, heads: int, rep: int, total: int) -> torch.Tensor:
        """Depthwise conv weight (heads·d, K), head-major channels: repeated like its heads, padded
        with zero heads to ``total``, then the rank's block of heads."""
        d = w.shape[0] // heads
        blocks = w.view(heads, d, -1)
        if rep > 1:
            blocks = blocks.repeat_interleave(rep, dim=0)
        if blocks.shape[0] < total:
            blocks = torch.cat([blocks, blocks.new_zeros(total - blocks.shape[0], *blocks.shape[1:])])
        per_rank = total // self.cp
        return blocks[self.rank * per_rank:(self.rank + 1) * per_rank].reshape(per_rank * d, -1)

    def _before(self, module: nn.Module, args: tuple) -> tuple:
        q, k, v, g, beta, conv_q, conv_k, conv_v = args[:8]
        cp, group = self.cp, self.group
        nk, nv = k.shape[2], v.shape[2]
        self.heads = nv  # the forward hook sees only the padded output
        rep, total = _read_repeats(nv, nk, cp), padded_heads(nv, cp)
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        if total != nv:
            q, k, v, g, beta = (_pad_heads(t, total) for t in (q, k, v, g, beta))
        return (
            seq_to_heads(q, cp, group), seq_to_heads(k, cp, group), seq_to_heads(v, cp, group),
            seq_to_heads(g.unsqueeze(-1), cp, group).squeeze(-1), seq_to_heads(beta.unsqueeze(-1), cp, group).squeeze(-1),
            self._heads_of_rank(conv_q, nk, rep, k.shape[2]), self._heads_of_rank(conv_k, nk, rep, k.shape[2]),
            self._heads_of_rank(conv_v, nv, 1, total),
            *args[8:],
        )

    def _after(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = heads_to_seq(out, self.cp, self.group)
        return out if out.shape[2] == self.heads else out[:, :, :self.heads]


def apply_ulysses(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Wrap every attention core and GatedDeltaNet recurrence of ``model`` for the cp mesh."""
    for module in model.modules():
        if isinstance(module, AttentionCore):
            UlyssesAttention(cp_mesh).apply(module)
        elif isinstance(module, GatedDeltaRule):
            UlyssesDeltaRule(cp_mesh).apply(module)
    return model


# --- sequence shards: inputs, labels, router statistics --------------------------------------------


@dataclass(frozen=True)
class SequenceShard:
    """This rank's contiguous 1/cp of every row: positions [rank·S/cp, (rank+1)·S/cp)."""

    cp: int
    rank: int
    group: Any  # the cp process group

    @classmethod
    def of(cls, parallel_dims) -> SequenceShard | None:
        """The shard of this rank under ``parallel_dims`` (None without context parallelism)."""
        if parallel_dims.cp == 1:
            return None
        mesh = parallel_dims.mesh["cp"]
        return cls(mesh.size(), mesh.get_local_rank(), mesh.get_group())

    @property
    def last(self) -> bool:
        return self.rank == self.cp - 1

    def bounds(self, full: int) -> tuple[int, int]:
        s = full // self.cp
        return self.rank * s, (self.rank + 1) * s

    def take(self, t: torch.Tensor, full: int | None = None, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``t`` along ``dim`` for a row of ``full`` positions (default: t's own
        length). A stream shorter than the row (the MTP targets) is clipped at its end."""
        a, b = self.bounds(t.shape[dim] if full is None else full)
        return t.narrow(dim, a, min(b, t.shape[dim]) - a)

    def sum_router_stats(self, stats: RouterStats) -> RouterStats:
        """Statistics of the whole sequence: every rank's sums added (one all-reduce). Autograd-aware:
        the backward sums the ranks' gradients, so a loss formed from the result on every rank and
        scaled by 1/cp has exactly one process's gradient."""
        E = stats.counts.numel()
        flat = torch.cat([stats.prob_sum.float(), stats.counts.float(), stats.tokens.float().reshape(1)])
        total = all_reduce(flat, "sum", self.group)  # autograd: the backward all-reduces the gradient
        return RouterStats(total[E:2 * E].detach(), total[:E], total[2 * E].detach())


def _pad_row(t: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """``t`` with one more row at the end of dim 1 (filled with ``value``)."""
    pad = torch.full_like(t.narrow(1, 0, 1), value)
    return torch.cat([t, pad], dim=1)


class _SequenceSharding:
    """The forward hooks that keep a text model's residual stream sequence-sharded over cp."""

    def __init__(self, shard: SequenceShard) -> None:
        self.shard = shard

    def text_input(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Text model entry: the (B, S) ids or (B, S, H) embeddings cut to the shard; positions made
        explicit for the whole row (rotary tables and documents are built from them)."""
        x, rest = args[0], list(args[1:])
        if "position_ids" in kwargs:
            pos = kwargs["position_ids"]
        else:
            pos = rest[0] if rest else None
        if pos is None:
            B, S = x.shape[:2]
            pos = torch.arange(S, device=x.device).unsqueeze(0).expand(B, S)
            if "position_ids" in kwargs or not rest:
                kwargs = {**kwargs, "position_ids": pos}
            else:
                rest[0] = pos
        # a later pipeline stage receives hidden states that are already this rank's shard
        whole = x.shape[1] == pos.shape[-1]
        return (self.shard.take(x) if whole else x, *rest), kwargs

    def layer_input(self, module: nn.Module, args: tuple) -> tuple:
        """Decoder layer entry: whole-row cos/sin and token mask cut to the stream's shard."""
        x, rest = args[0], args[1:]
        full = x.shape[1] * self.shard.cp

        def fit(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == full:
                return self.shard.take(t)
            return t

        return (x, *(fit(t) for t in rest))

    def deepstack_input(self, module: nn.Module, args: tuple) -> tuple:
        """DeepStack: the visual mask and the feature rows (row-major visual order) of the shard."""
        hidden, mask, feature = args
        order = mask.reshape(-1).long().cumsum(0).view(mask.shape) - 1  # feature row of each visual token
        local = self.shard.take(mask)
        return hidden, local, feature[self.shard.take(order)[local.bool()]]

    def mtp_input(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """MTP head entry, (embeds (B, S, H) whole, hidden (B, S/cp, H) shard, cos/sin and mask of
        the S − 1 stream rows, doc of that stream): the module shifts by one inside, so it gets the
        embeddings of [a, b + 1) and the shard's hidden states plus one dropped row; the last rank,
        whose stream ends one row early, pads a masked row (the last of its row: causal layers never
        let it reach another) so every shard has S/cp rows."""
        sh = self.shard
        embeds, hidden, cos, sin = args[:4]
        mask = args[4] if len(args) > 4 else kwargs.pop("token_mask", None)
        S = embeds.shape[1]
        a, b = sh.bounds(S)
        embeds = embeds[:, a:b + 1]
        hidden = torch.cat([hidden, hidden[:, -1:]], dim=1)
        cos, sin = sh.take(cos, full=S), sh.take(sin, full=S)
        if mask is not None:
            mask = sh.take(mask, full=S)
        if sh.last:
            embeds = _pad_row(embeds)
            cos, sin = torch.cat([cos, cos[:, -1:]], 1), torch.cat([sin, sin[:, -1:]], 1)
            if mask is None:
                mask = torch.ones(hidden.shape[0], S - 1 - a, dtype=torch.long, device=hidden.device)
            mask = _pad_row(mask)
        doc = kwargs.get("doc")
        if doc is not None:  # the stream's documents, whole (the kernels read them after the all-to-all)
            kwargs = {**kwargs, "doc": Documents.from_starts(_pad_row(doc.starts, False))}
        return (embeds, hidden, cos, sin, mask), kwargs

    def mtp_output(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        # a copy, not a view: a fused head hands these rows on untouched, and FSDP's root warns
        # about every view in the model's output (in-place ops on one would skip its all-gather)
        return out[:, :-1].clone() if self.shard.last else out


def apply_context_parallel(model: nn.Module, text_model: nn.Module, parallel_dims,
                           mtp: nn.Module | None = None) -> nn.Module:
    """Sequence-shard ``text_model``'s residual stream (and the MTP head's) over the cp mesh and wrap
    every attention core and GatedDeltaNet recurrence with the Ulysses all-to-alls. After tensor
    parallelism: the entry hook runs before TP's (it cuts the plain full input, TP then shards the
    cut over tp), the MTP hooks after TP's gather / before TP's re-wrap."""
    shard = SequenceShard.of(parallel_dims)
    if shard is None:
        return model
    hooks = _SequenceSharding(shard)
    text_model.register_forward_pre_hook(hooks.text_input, with_kwargs=True, prepend=True)
    for layer in text_model.layers.values():
        layer.register_forward_pre_hook(hooks.layer_input)
    deepstack = getattr(text_model, "deepstack", None)
    if deepstack is not None:
        deepstack.register_forward_pre_hook(hooks.deepstack_input)
    if mtp is not None:
        mtp.register_forward_pre_hook(hooks.mtp_input, with_kwargs=True)
        mtp.register_forward_hook(hooks.mtp_output, with_kwargs=True, prepend=True)
    cp_mesh = parallel_dims.mesh["cp"]
    apply_ulysses(text_model, cp_mesh)
    if mtp is not None:
        apply_ulysses(mtp, cp_mesh)
    return model
