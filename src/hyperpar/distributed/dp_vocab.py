"""The embedding and the head sharded by vocabulary over the FSDP ranks (``parallel.fsdp_vocab_parallel``).

FSDP gathers every unit's whole weight on every rank. For the root unit, the input embedding and the
head, that is the largest gather of the step and grows with the vocabulary (2 x 248k x hidden for
an untied Qwen3.5), while the activations those weights meet are small: a rank's own tokens.
Here each rank keeps its vocabulary rows (``Shard(0)`` over the FSDP mesh, torch.chunk's split, the
placement FSDP's own shards have) and the ranks exchange tokens instead of weights:

- embedding: the token ids are all-gathered, each rank looks up the ids in its rows (zeros
  elsewhere) for every rank's tokens, and a reduce-scatter hands each rank its own tokens' vectors
  (one rank contributes each value, the others exact zeros). Backward all-gathers the vectors'
  gradients and each rank adds them into its own rows.
- head + loss: the final hidden states and labels are all-gathered; each rank forms the logits of
  every rank's tokens over its rows, chunk by chunk, exchanges each row's max, sum of exps and
  target logit (one all-gather per chunk) for the log-sum-exp, turns the logits into their gradient
  in place, and accumulates its rows' weight gradient (whole: every token of the step has been
  seen) and the hidden states' partial gradient, which a reduce-scatter sums over the vocabulary
  shards into each rank's own rows.

Per step and micro-batch that moves tokens x hidden values four times instead of the two weights
(gathered, and their gradients reduce-scattered); the weights' gradients need no reduction over
the shard axis (under HSDP, one all-reduce over the replicas).
It pays while the data-parallel ranks' tokens together are fewer than the vocabulary. The step's
loss and gradients are the same sums as one process's, in another order (fp32 parity).

The weights are sharded over FSDP's own axis, ``dp_shard x cp`` (every rank of it holds different
tokens), and under HSDP replicated over ``dp_replicate`` like FSDP's own parameters, their gradients
summed over the replicas once a step (``reduce_replicas``, called by the trainer). Supported with
FSDP, HSDP and context parallelism, experts included, in fp32 and 16-bit compute; refused with tp
and pp (``check``). With one FSDP rank there is nothing to shard and the option changes nothing
(a parity sweep's ``single`` job runs as ever).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hyperpar.errors import PlanError
from hyperpar.models.layers import cpu_matmul
from hyperpar.models.layers.lm_head import LMHead
from hyperpar.train.cross_entropy import IGNORE_INDEX, _head_rows, _hint_tensor, _row_chunk

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check(parallel_dims, fused_head_loss: bool = True) -> None:
    """PlanError for a layout the vocabulary sharding does not cover."""
    bad = [f"{axis}={getattr(parallel_dims, axis)}" for axis in ("tp", "pp") if getattr(parallel_dims, axis) > 1]
    if not fused_head_loss:  # the head's matmul lives in the sharded loss kernel
        bad.append("train.fused_head_loss=false")
    if bad:
        raise PlanError(f"not supported: parallel.fsdp_vocab_parallel with {', '.join(bad)}",
                        hint="it shards the embedding and head over plain FSDP ranks; set "
                        "parallel.fsdp_vocab_parallel=false for this layout")


def _group(weight: DTensor):
    """The process group of the weight's shard axis (the mesh's last dim; the first replicates)."""
    mesh = weight.device_mesh
    return mesh.get_group(mesh.ndim - 1)


def _vocab_range(weight: DTensor) -> tuple[int, int]:
    """This rank's rows [lo, hi) of a Shard(0) weight, by torch.chunk's split (DTensor's own)."""
    mesh = weight.device_mesh
    n, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    per = -(-weight.shape[0] // n)
    lo = min(per * rank, weight.shape[0])
    return lo, lo + weight.to_local().shape[0]


def shard_vocab(model: nn.Module, mesh, compute_dtype: torch.dtype = torch.float32) -> set[nn.Parameter]:
    """Turn the text embedding and every ``LMHead``'s weight (one parameter when tied) into DTensors
    on FSDP's 2-D ``mesh`` (replicate, shard), placed as FSDP places its own parameters: replicated
    over the first dim, ``Shard(0)`` over the second; route the embeddings through
    ``VocabShardedEmbedding``, record the weights for ``reduce_replicas``, and
    return the parameters FSDP must leave alone (``fully_shard(..., ignored_params=...)``). The
    weights stay in their dtype (fp32: FSDP's sharded parameters'); ``compute_dtype`` is what the
    embeddings hand on (FSDP's ``param_dtype``: its 16-bit lookup is the rounded fp32 one)."""
    vocab = {m.weight.shape[0] for m in model.modules() if isinstance(m, LMHead)}
    targets: list[nn.Module] = [m for m in model.modules() if isinstance(m, LMHead)]
    # the text model's token embedding (a vision tower's position table is an nn.Embedding too)
    targets += [m for name, m in model.named_modules()
                if name.rsplit(".", 1)[-1] == "embed_tokens" and type(m) is nn.Embedding and m.num_embeddings in vocab]
    if not targets:
        raise PlanError("parallel.fsdp_vocab_parallel: the model has no LM head to shard")
    n = mesh.size(mesh.ndim - 1)
    for v in vocab:
        if -(-v // n) * (n - 1) >= v:  # torch.chunk's split leaves the last rank nothing
            raise PlanError(f"parallel.fsdp_vocab_parallel: vocabulary {v} leaves a rank of the {n} FSDP ranks no rows",
                            hint="set parallel.fsdp_vocab_parallel=false")
    done: dict[int, nn.Parameter] = {}
    for module in targets:
        w = module.weight
        if id(w) not in done:
            placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
            done[id(w)] = nn.Parameter(distribute_tensor(w.data, mesh, placements, src_data_rank=None), w.requires_grad)
        module.weight = done[id(w)]
        module._hyperpar_dp_vocab = True  # the module's mark (lm_head.vocab_sharded): materialising replaces the parameter
        module._hyperpar_compute_dtype = compute_dtype
        if isinstance(module, nn.Embedding):
            module.__class__ = VocabShardedEmbedding
    model._hyperpar_dp_vocab_modules = targets
    return set(done.values())


def reduce_replicas(parts) -> None:
    """Sum the vocabulary-sharded weights' gradients over FSDP's replicate dim (HSDP): each replica's
    ranks saw only their tokens. Once per optimizer step, after the last micro-batch's backward, on
    every rank (as FSDP reduces its own units then); nothing without replicas."""
    seen: set[int] = set()
    for part in parts:
        for module in getattr(part, "_hyperpar_dp_vocab_modules", ()):
            w = module.weight
            if id(w) in seen or w.grad is None or w.device_mesh.ndim < 2 or w.device_mesh.size(0) == 1:
                continue
            seen.add(id(w))
            dist.all_reduce(w.grad.to_local(), group=w.device_mesh.get_group(0))


class VocabShardedEmbedding(nn.Embedding):
    """``nn.Embedding`` (same parameter and keys) whose weight is vocabulary-sharded over the
    data-parallel ranks (only ``shard_vocab`` makes one): every rank must call it, with its own ids,
    once per call site."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        lo, hi = _vocab_range(self.weight)
        out = _ShardedLookup.apply(input_ids.reshape(-1), self.weight.to_local(), lo, hi, _group(self.weight))
        out = out.to(getattr(self, "_hyperpar_compute_dtype", out.dtype))
        return out.view(*input_ids.shape, out.shape[-1])


def _rows_of_every_rank(x: torch.Tensor, group, pad: float | int) -> tuple[torch.Tensor, list[int], int]:
    """All-gather (T_r, ...) tensors whose T_r may differ: (ranks x max T, ...) with each rank's rows
    padded by ``pad`` at the end of its block; the ranks' T_r and the block size."""
    n = dist.get_world_size(group)
    size = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = torch.empty(n, dtype=torch.int64, device=x.device)
    _gather(sizes, size, group=group)
    counts = sizes.tolist()
    block = max(counts)
    if x.shape[0] < block:
        x = torch.cat([x, x.new_full((block - x.shape[0], *x.shape[1:]), pad)])
    out = x.new_empty((n * block, *x.shape[1:]))
    _gather(out, x.contiguous(), group=group)
    return out, counts, block


def _scatter_own_rows(x: torch.Tensor, group, count: int) -> torch.Tensor:
    """Reduce-scatter (ranks x block, ...) partial sums: this rank's block summed over the ranks,
    cut to its ``count`` rows."""
    n = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out[:count]


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, lo: int, hi: int, group) -> torch.Tensor:  # type: ignore[override]
        every, _, block = _rows_of_every_rank(ids, group, pad=-1)
        mine = (every >= lo) & (every < hi)
        local = (every - lo).masked_fill_(~mine, 0)
        vectors = nn.functional.embedding(local, weight)
        vectors.masked_fill_(~mine.unsqueeze(1), 0.0)
        ctx.save_for_backward(local, mine)
        ctx.group, ctx.rows, ctx.block = group, weight.shape[0], block
        return _scatter_own_rows(vectors, group, ids.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        local, mine = ctx.saved_tensors
        if grad.shape[0] < ctx.block:
            grad = torch.cat([grad, grad.new_zeros((ctx.block - grad.shape[0], grad.shape[1]))])
        every = grad.new_empty((local.shape[0], grad.shape[1]))
        _gather(every, grad.contiguous(), group=ctx.group)
        dw = every.new_zeros((ctx.rows, every.shape[1]))
        dw.index_add_(0, local[mine], every[mine])
        return None, dw, None, None, None


def _row_stats_(p: torch.Tensor, local: torch.Tensor, blk: int, round_to: torch.dtype | None = None) -> torch.Tensor:
    """(3, rows): each row's max over this rank's logits ``p``, the sum of exp(logit - that max), and
    the target's logit (garbage where another rank holds the target; masked by the caller). ``p`` is
    overwritten by exp(logit - its row's max), one block of rows at a time, in cache. ``round_to``:
    the logits are first rounded to that 16-bit dtype's values (what a 16-bit head's logits hold)."""
    stats = p.new_empty((3, p.shape[0]))  # (shard_vocab refuses a rank with no rows)
    for b in range(0, p.shape[0], blk):
        x = p[b:b + blk]
        if round_to is not None:
            x.copy_(x.to(round_to))
        m = x.amax(dim=1, keepdim=True)
        stats[0, b:b + blk] = m.squeeze(1)
        stats[2, b:b + blk] = x.gather(1, local[b:b + blk]).squeeze(1)
        stats[1, b:b + blk] = x.sub_(m).exp_().sum(dim=1)
    return stats


class _ShardedLinearCrossEntropySum(torch.autograd.Function):
    """Σ CE of ``hidden @ weight.T`` over this rank's tokens, with ``weight`` this rank's vocabulary
    rows [lo, hi): every rank's tokens pass through every rank's rows (module docstring). Per chunk of
    rows one all-gather of each rank's (max, sum of exps, target logit) per row gives the log-sum-exp;
    the element-wise passes run over cache-sized blocks of the chunk. Both gradients are formed in the
    forward for the upstream gradient ``grad_hint`` (each rank's own; the objective's 1 / global
    tokens is the same everywhere); the backward checks that every rank's real upstream gradient has
    the same ratio to its hint and rescales by it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                grad_hint: torch.Tensor, grads: bool, lo: int, hi: int, group) -> torch.Tensor:
        n = dist.get_world_size(group)
        T = hidden.shape[0]
        want_h, want_w = (bool(ctx.needs_input_grad[i]) and grads for i in (0, 1))
        h_all, _, block = _rows_of_every_rank(hidden.float(), group, pad=0.0)
        labels_all, _, _ = _rows_of_every_rank(labels, group, pad=IGNORE_INDEX)
        hints = torch.empty(n, dtype=torch.float32, device=hidden.device)
        _gather(hints, grad_hint.float().reshape(1), group=group)
        valid = labels_all != IGNORE_INDEX
        mine = valid & (labels_all >= lo) & (labels_all < hi)
        local = (labels_all - lo).masked_fill_(~mine, 0).unsqueeze(1)
        scale = hints.repeat_interleave(block) * valid.float()  # each row's gradient: its rank's hint
        # 16-bit compute (train.mixed_precision.param_dtype): the weight's 16-bit values; the GEMMs in
        # 16 bits, or in fp32 on the 16-bit values where the CPU's 16-bit matmuls run as fp32 GEMMs
        # (cpu_matmul), with the logits and their gradient rounded where a 16-bit head rounds them
        half = hidden.dtype if hidden.dtype != torch.float32 else None
        native = half is not None and not cpu_matmul.upcast(hidden)
        w = weight.to(half).float() if half and not native else weight.float()
        w16 = weight.to(half) if native else None
        rows_all = h_all.shape[0]
        nll = torch.empty(rows_all, dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(h_all) if want_h else None
        dw = None
        # the one-rank fused head's chunk and block sizes, for this rank's rows
        step, blk = _head_rows(w.shape[0], hidden.device), _row_chunk(w.shape[0], hidden.device)
        for a in range(0, rows_all, step):
            rows = slice(a, min(a + step, rows_all))
            h = h_all[rows]
            h16 = h.to(half) if native else None
            p = (h16 @ w16.t()).float() if native else h @ w.t()  # (rows, V_local)
            # p: exp(logit - this rank's row max)
            stats = _row_stats_(p, local[rows], blk, round_to=half if half and not native else None)
            stats[2].mul_(mine[rows])
            every = stats.new_empty((n * 3, stats.shape[1]))
            _gather(every, stats, group=group)
            every = every.view(n, 3, -1)
            top = every[:, 0].amax(dim=0)
            lse = top + (every[:, 1] * (every[:, 0] - top).exp()).sum(dim=0).log()
            nll[rows] = lse - every[:, 2].sum(dim=0)
            if not (want_h or want_w):
                continue
            g = scale[rows]
            coef = (stats[0] - lse).exp_().mul_(g).unsqueeze(1)  # exp(max - lse) x scale
            for b in range(0, p.shape[0], blk):  # softmax x scale - onehot x scale, in place
                x = p[b:b + blk]
                x.mul_(coef[b:b + blk])
                x.scatter_add_(1, local[rows][b:b + blk], -(g[b:b + blk] * mine[rows][b:b + blk]).unsqueeze(1))
                if half and not native:  # the 16-bit gradient's values
                    x.copy_(x.to(half))
            if native:
                p16 = p.to(half)
                p = None
                if want_h:
                    dh[rows] = p16 @ w16
                if want_w:
                    part = (p16.t() @ h16).float()
                    dw = part if dw is None else dw.add_(part)
                continue
            if want_h:
                torch.mm(p, w, out=dh[rows])
            if want_w and dw is None:
                dw = p.t() @ h
            elif want_w:
                dw.addmm_(p.t(), h)
        if want_w and dw is None:  # no rows at all
            dw = torch.zeros_like(w)
        me = dist.get_rank(group)
        own = slice(me * block, me * block + T)
        loss = (nll[own] * valid[own]).sum()
        dh_own = _scatter_own_rows(dh, group, T).to(hidden.dtype) if want_h else None
        ctx.save_for_backward(dh_own, dw.to(weight.dtype) if dw is not None else None, grad_hint)
        ctx.group = group
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dh, dw, hint = ctx.saved_tensors
        ratio = (grad.float() / hint.float()).reshape(1)
        ratios = ratio.new_empty(dist.get_world_size(ctx.group))
        _gather(ratios, ratio, group=ctx.group)
        if not bool((ratios == ratios[0]).all()):
            raise RuntimeError("the vocabulary-sharded head got upstream gradients in different ratios to "
                               f"their hints on the data-parallel ranks ({ratios.tolist()}); its weight gradient "
                               "sums every rank's tokens and needs one ratio")
        if float(ratios[0]) != 1.0:
            dh = dh * ratio.to(dh.dtype) if dh is not None else None
            dw = dw * ratio.to(dw.dtype) if dw is not None else None
        return dh, dw, None, None, None, None, None, None


def sharded_linear_cross_entropy_sum(hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor,
                                     grad_hint: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``linear_cross_entropy_sum`` for a vocabulary-sharded head weight (``shard_vocab``): this rank's
    (T, H) ``hidden`` and (T,) ``labels``; a collective over the weight's mesh."""
    lo, hi = _vocab_range(weight)
    hint = _hint_tensor(grad_hint, hidden.device, "sharded_linear_cross_entropy_sum")
    return _ShardedLinearCrossEntropySum.apply(hidden, weight.to_local(), labels, hint, torch.is_grad_enabled(),
                                               lo, hi, _group(weight))
