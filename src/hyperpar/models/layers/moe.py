"""Mixture of experts (MODELS.md 6): top-k router, packed experts run as grouped GEMMs, optional
sigmoid-gated shared expert, and the router statistics the load-balancing loss is made of.

Layout: ``experts.gate_proj`` / ``experts.up_proj`` (E, Ie, H) and ``experts.down_proj`` (E, H, Ie).
Checkpoints fuse gate and up (``gate_up_proj`` (E, 2·Ie, H), rows [gate; up]); here they are two
parameters so tensor parallelism can shard both halves on Ie with a plain split (the adapters fuse
and unfuse them). The grouped GEMM reads the transposed (E, H, ·) views at no cost.

Expert compute sits behind one function, ``experts_forward(x_sorted, counts, w_gate, w_up, w_down)``:
rows arrive sorted by expert with a row count per expert, which is what an expert-parallel
all-to-all produces, so expert parallelism can wrap ``GroupedExperts`` (or that function) without
touching the router or the combine.

Router statistics. The auxiliary loss pools f and P over *all* MoE layers of one forward call before
the product (MODELS.md 6.3, 17), so no layer can form it. Every block computes its
``RouterStats`` (per-expert top-k counts, per-expert probability sums, token count) on every forward
— the same ops whether anyone listens or not, so activation-checkpoint recomputation replays the
forward exactly — and appends them to the innermost ``record_router_stats()`` context if one is
open. The model opens that context around its forward and calls ``load_balancing_loss`` on what was
collected. Recomputation during backward runs outside the context and records nothing.

Route records. Top-k routing is discontinuous: a token whose k-th and (k+1)-th router probabilities
tie within rounding goes to either expert, and two layouts (whose sums round differently) may send
it to different ones; from there their losses part by far more than rounding. To tell such a tie from
a layout that routes wrongly, ``record_routes()`` collects, per block (by its ``route_key``), how many
real tokens each expert got and the smallest top-k margin (``p_k - p_{k+1}``) over those tokens. Like
the statistics, only a forward inside ``record_router_stats()`` records (not a recomputation).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.errors import ConfigError
from hyperpar.models.layers import onednn_gemm
from hyperpar.models.layers.cpu_matmul import Linear, linear, upcast
from hyperpar.models.layers.local import local
from hyperpar.models.layers.mlp import SwiGLUMLP
from hyperpar.unfilled import empty_unfilled

__all__ = [
    "GroupedExperts",
    "RouteRecord",
    "RouterStats",
    "Routing",
    "SparseMoeBlock",
    "TopKRouter",
    "experts_forward",
    "grouped_mm_supported",
    "load_balancing_loss",
    "record_router_stats",
    "record_routes",
    "router_stats",
]


# --- router statistics and the load-balancing loss ----------------------------------------------


@dataclass
class RouterStats:
    """What one forward call's router(s) did; adding two pools them (layers, micro-batches, ranks)."""

    counts: torch.Tensor  # (E,) fp32, no grad: top-k assignments per expert
    prob_sum: torch.Tensor  # (E,) fp32: Σ over tokens of the softmax probability (carries the grad)
    tokens: torch.Tensor  # () fp32: tokens counted (one per token per layer)

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.counts + other.counts, self.prob_sum + other.prob_sum, self.tokens + other.tokens)

    @staticmethod
    def pool(stats: Sequence["RouterStats"]) -> "RouterStats":
        if not stats:
            raise ValueError("no router statistics to pool")
        out = stats[0]
        for s in stats[1:]:
            out = out + s
        return out


def router_stats(probs: torch.Tensor, indices: torch.Tensor, token_mask: torch.Tensor | None = None) -> RouterStats:
    """Statistics of one router call: probs (T, E) fp32 softmax, indices (T, k) chosen experts,
    token_mask (T,) or any shape with T elements, nonzero = a real token (padding is left out)."""
    T, E = probs.shape
    k = indices.shape[-1]
    flat = indices.reshape(-1)
    if token_mask is None:
        with torch.no_grad():
            counts = torch.zeros(E, dtype=torch.float32, device=probs.device).index_add_(
                0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=probs.device)
            )
            tokens = torch.tensor(float(T), device=probs.device)
        return RouterStats(counts, probs.float().sum(0), tokens)
    if token_mask.numel() != T:
        raise ValueError(f"token_mask has {token_mask.numel()} elements for {T} tokens")
    m = token_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    with torch.no_grad():
        counts = torch.zeros(E, dtype=torch.float32, device=probs.device).index_add_(0, flat, m.repeat_interleave(k))
        tokens = m.sum()
    return RouterStats(counts, (probs.float() * m.unsqueeze(-1)).sum(0), tokens)


def load_balancing_loss(stats: RouterStats | Sequence[RouterStats]) -> torch.Tensor:
    """``E · Σ_e f_e · P_e`` with ``f = counts / tokens`` and ``P = prob_sum / tokens``, pooled first.

    Not multiplied by ``router_aux_loss_coef``. Equals k for perfectly uniform routing. For the
    single-process value across ranks (or pipeline stages), all-reduce counts, prob_sum and tokens
    (prob_sum with an autograd-aware collective) before calling this. No tokens → 0.
    """
    s = stats if isinstance(stats, RouterStats) else RouterStats.pool(list(stats))
    rows = s.tokens.clamp_min(1.0)
    return s.counts.numel() * torch.sum((s.counts / rows) * (s.prob_sum / rows))


_ACTIVE_SINK: ContextVar[list[RouterStats] | None] = ContextVar("hyperpar_router_stats", default=None)


@contextmanager
def record_router_stats() -> Iterator[list[RouterStats]]:
    """Collect the ``RouterStats`` of every MoE block that runs inside the block (nested contexts:
    the innermost one collects)."""
    sink: list[RouterStats] = []
    token = _ACTIVE_SINK.set(sink)
    try:
        yield sink
    finally:
        _ACTIVE_SINK.reset(token)


def _publish(stats: RouterStats) -> None:
    sink = _ACTIVE_SINK.get()
    if sink is not None:
        sink.append(stats)


@dataclass
class RouteRecord:
    """Where the routers sent this process's real tokens inside one ``record_routes()`` context: per
    block's ``route_key``, the top-k assignments per expert (fp32, exact integers), and the smallest
    top-k margin over every token routed (None: no token)."""

    counts: dict[str, torch.Tensor]
    margin: torch.Tensor | None = None

    def add(self, other: "RouteRecord") -> None:
        for key, c in other.counts.items():
            self.counts[key] = c if key not in self.counts else self.counts[key] + c
        if other.margin is not None:
            self.margin = other.margin if self.margin is None else torch.minimum(self.margin, other.margin)


_ACTIVE_ROUTES: ContextVar[RouteRecord | None] = ContextVar("hyperpar_route_record", default=None)


@contextmanager
def record_routes() -> Iterator[RouteRecord]:
    """Collect a ``RouteRecord`` of every keyed MoE block's forward inside (see the module doc)."""
    record = RouteRecord({})
    token = _ACTIVE_ROUTES.set(record)
    try:
        yield record
    finally:
        _ACTIVE_ROUTES.reset(token)


def active_route_record() -> RouteRecord | None:
    """The innermost open ``record_routes()`` record, if any."""
    return _ACTIVE_ROUTES.get()


def top_k_margin(probs: torch.Tensor, indices: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """min over (real) tokens of (the smallest chosen probability - the largest one not chosen); None
    when no token counts or every expert is chosen."""
    T, E = probs.shape
    if indices.shape[-1] >= E or T == 0:
        return None
    with torch.no_grad():
        p = probs.detach().float()
        chosen = p.gather(1, indices).amin(1)
        rest = p.scatter(1, indices, -1.0).amax(1)  # probabilities are >= 0
        margin = chosen - rest
        if token_mask is not None:
            margin = margin.masked_fill(token_mask.reshape(-1).to(margin.device) == 0, float("inf"))
        out = margin.amin()
    return out


def _note_routes(key: str | None, stats: RouterStats, routing: "Routing", token_mask: torch.Tensor | None) -> None:
    record = _ACTIVE_ROUTES.get()
    if record is None or key is None or _ACTIVE_SINK.get() is None:  # no record, or a recomputation
        return
    record.add(RouteRecord({key: stats.counts.detach()}, top_k_margin(routing.probs, routing.indices, token_mask)))


# --- router -------------------------------------------------------------------------------------


class Routing(NamedTuple):
    logits: torch.Tensor  # (T, E) activation dtype (what transformers reports as router_logits)
    probs: torch.Tensor  # (T, E) fp32 softmax over all experts
    weights: torch.Tensor  # (T, k) activation dtype, renormalised to sum to 1
    indices: torch.Tensor  # (T, k) int64, by descending probability


class TopKRouter(nn.Module):
    """``mlp.gate``: logits = x·Wᵀ, softmax in fp32, top-k, renormalised, cast back.

    Qwen3.5-MoE and Qwen3-VL-MoE (transformers 5.24) always renormalise: their configs'
    ``norm_topk_prob`` is ignored there and here (see ``hf_args.note_router_renormalises``).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: (T, H)."""
        # The BLAS's sums in fp32, not oneDNN's (launch.cpu_gemm): a tiny GEMM whose rounding picks
        # routes, kept like transformers' so a near-tied route falls the same way.
        logits = linear(x, self.weight, onednn=False)  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)  # sorted, descending
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, top_p.to(logits.dtype), top_i)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}"


# --- expert compute -----------------------------------------------------------------------------


def _aligned(*sizes_in_bytes: int) -> bool:
    return all(s % 16 == 0 for s in sizes_in_bytes)


def grouped_mm_supported(x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run this expert MLP here.

    CPU: fp32 and bf16, forward and backward (a loop of mm per expert inside the kernel). CUDA: bf16
    on sm80+. All kernels want 16-byte aligned row strides (H, Ie, 2·Ie). Anything else (fp16, NPU,
    odd sizes) takes the sort-and-loop path, which gives the same numbers.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    dev = x.device.type
    dtype = w_gate.dtype
    if x.dtype != dtype or w_down.dtype != dtype:
        return False
    if dev == "cpu":
        ok_dtype = dtype in (torch.float32, torch.bfloat16)
    elif dev == "cuda":
        ok_dtype = dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    else:
        return False
    e = x.element_size()
    H, Ie = w_down.shape[1], w_down.shape[2]
    return ok_dtype and _aligned(H * e, Ie * e)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] · w[e]ᵀ`` for w (E, out, in), groups given by cumulative ends.

    Own backward (also grouped GEMMs) because the built-in one rejects non-contiguous incoming
    gradients (e.g. from ``y.sum()``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offs)
        if upcast(x):  # no 16-bit GEMM on this CPU: fp32 GEMMs on the 16-bit values
            return torch._grouped_mm(x.float(), w.float().transpose(-2, -1), offs=offs).to(x.dtype)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        dtype = x.dtype
        if upcast(x):
            g, x, w = g.float(), x.float(), w.float()
        dx = torch._grouped_mm(g, w, offs=offs).to(dtype) if ctx.needs_input_grad[0] else None
        # (out, N) x (N, in) grouped over N: one (out, in) block per expert, zeros for empty ones.
        dw = torch._grouped_mm(g.t(), x, offs=offs).to(dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if upcast(a):  # no 16-bit GEMM on this CPU: an fp32 GEMM on the 16-bit values, rounded into out
        out.copy_(a.float() @ b.float())
    elif onednn_gemm.applies(a, b, None):  # fp32 on a CPU where oneDNN's GEMM is the faster (launch.cpu_gemm)
        out.copy_(onednn_gemm.mm(a, b))
    else:
        torch.mm(a, b, out=out)


# oneDNN (fp32 through ``onednn_gemm``, 16-bit through torch's mm) allocates its own output,
# reorders and transposed copies, so a loop over experts makes temporaries whose sizes follow each
# step's routing. glibc's heap, which keeps freed memory (``launch.host_allocator=retain``),
# fragments on sizes that never repeat: moe_small's fp32 step grew its peak RSS 3.0 -> 4.9 GB over
# 16 steps with 16-56k page faults a step. So each expert's rows go in as a multiple of
# ``_ROW_QUANTUM`` and the rest (< 64 rows, small temporaries), and the weight gradient, whose
# sum runs over the rows, as two GEMMs summed in fp32, or in 16 bits as one GEMM over operands
# zero-padded to whole quanta (one rounding, as unpadded): the big temporaries come in a few sizes
# that freed blocks fit again (fp32: 4.0-4.3 GB, faults rare after the third step).
_ROW_QUANTUM = 64


def _row_pieces(n: int, quantum: int) -> list[tuple[int, int]]:
    """[0, n) as (start, end) pieces: a multiple of ``quantum`` rows, then the rest (0: whole)."""
    m = n - n % quantum if quantum else n
    return [(a, b) for a, b in ((0, m), (m, n)) if b > a]


def _quantum(x: torch.Tensor) -> int:
    # where a CPU's expert GEMMs are oneDNN's: fp32 under launch.cpu_gemm, 16-bit through torch's mm
    # (fp32 and fp64 through the BLAS write into the slices: no temporaries there)
    if x.device.type != "cpu":
        return 0
    if x.dtype == torch.float32:
        return _ROW_QUANTUM if onednn_gemm.uses_onednn() else 0
    return _ROW_QUANTUM if x.dtype in (torch.bfloat16, torch.float16) else 0


def _weight_grad_into(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, quantum: int) -> None:
    """``out = gᵀ x`` over one expert's rows, in whole quanta where ``quantum`` (above)."""
    n = g.shape[0]
    rest = n % quantum if quantum else 0
    if not rest or n < quantum:
        _mm_into(g.t(), x, out)
    elif g.dtype == torch.float32:  # fp32 sums: the split changes only their order
        _mm_into(g[: n - rest].t(), x[: n - rest], out)
        out.addmm_(g[n - rest :].t(), x[n - rest :])
    else:  # 16-bit: summed in two parts the gradient would be rounded twice
        padded = n - rest + quantum
        gt = empty_unfilled((g.shape[1], padded), g.dtype, g.device)
        gt[:, n:].zero_()
        gt[:, :n].copy_(g.t())
        xp = empty_unfilled((padded, x.shape[1]), x.dtype, x.device)
        xp[n:].zero_()
        xp[:n].copy_(x)
        _mm_into(gt, xp, out)


# The loop's forward as one op of its own: its GEMMs write into slices of one output (``mm`` with
# ``out=``), which selective activation checkpointing cannot keep (a kept in-place result would not be
# written into the recompute's buffer), so it recomputed them; this op's output it keeps
# (``distributed/activation_checkpoint.py``). Any device: the kernel is made of torch's own ops.
_LIB = torch.library.Library("hyperpar", "FRAGMENT")
_LIB.define("expert_loop_mm(Tensor x, Tensor w, int[] sizes, int quantum) -> Tensor")


def _expert_loop_mm(x: torch.Tensor, w: torch.Tensor, sizes: list[int], quantum: int) -> torch.Tensor:
    out = empty_unfilled((x.shape[0], w.shape[1]), x.dtype, x.device)  # every row written below
    start = 0
    for e, n in enumerate(sizes):
        for a, b in _row_pieces(n, quantum):
            _mm_into(x[start + a : start + b], w[e].t(), out[start + a : start + b])
        start += n
    return out


_LIB.impl("expert_loop_mm", _expert_loop_mm, "CompositeExplicitAutograd")


@torch.library.register_fake("hyperpar::expert_loop_mm")
def _(x: torch.Tensor, w: torch.Tensor, sizes: list[int], quantum: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


class _LoopLinear(torch.autograd.Function):
    """Same as ``_GroupedLinear`` with one mm per non-empty expert on contiguous slices (on a CPU in
    whole ``_ROW_QUANTUM`` row blocks and the rest)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:  # type: ignore[override]
        q = _quantum(x)
        out = torch.ops.hyperpar.expert_loop_mm(x, w, sizes, q)
        ctx.sizes, ctx.quantum = sizes, q
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = empty_unfilled(x.shape, x.dtype, x.device) if ctx.needs_input_grad[0] else None
        dw = empty_unfilled(w.shape, w.dtype, w.device) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.sizes):
            if dx is not None:
                for a, b in _row_pieces(n, ctx.quantum):
                    _mm_into(g[start + a : start + b], w[e], dx[start + a : start + b])
            if dw is not None and n:
                _weight_grad_into(g[start : start + n], x[start : start + n], dw[e], ctx.quantum)
            elif dw is not None:
                dw[e].zero_()
            start += n
        return dx, dw, None


EXPERTS_IMPLS = ("auto", "grouped", "loop")  # model.experts_impl


def experts_forward(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert.

    x (N, H), rows of expert 0 first, then expert 1, …; counts (E,) integer rows per expert
    (Σ = N, zeros allowed); w_gate, w_up (E, Ie, H); w_down (E, H, Ie).
    Returns (N, H) in x's row order: ``down[e] · (silu(gate[e]·x) ⊙ up[e]·x)``.
    impl: "grouped" (``torch._grouped_mm``), "loop" (one mm per non-empty expert) or "auto".
    """
    named = impl != "auto"
    if not named:
        # a CPU's oneDNN GEMMs (fp32 under launch.cpu_gemm, 16-bit): the loop, in row quanta
        # (``_ROW_QUANTUM``; torch's grouped GEMM fragments the heap as the plain loop did)
        impl = "grouped" if grouped_mm_supported(x, w_gate, w_down) and not _quantum(w_gate) else "loop"
    if x.dtype != w_gate.dtype:  # e.g. fp32 activations reaching bf16 expert weights
        x = x.to(w_gate.dtype)
    if named and impl == "grouped" and not grouped_mm_supported(x, w_gate, w_down):
        # asked for by name (model.experts_impl): said here, not as torch's kernel error mid-step
        raise ConfigError(f"experts_impl=grouped: torch._grouped_mm cannot run these experts here ({x.device.type}, "
                          f"{str(w_gate.dtype).removeprefix('torch.')}, expert sizes {tuple(w_down.shape[1:])})",
                          hint="use model.experts_impl=auto or loop")
    if impl == "grouped":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)

        def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _GroupedLinear.apply(a, w, offs)

    elif impl == "loop":
        sizes = [int(n) for n in counts.tolist()]  # the one host sync of this path

        def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _LoopLinear.apply(a, w, sizes)

    else:
        raise ValueError(f"unknown experts impl '{impl}' (one of {', '.join(EXPERTS_IMPLS)})")
    h = F.silu(linear(x, w_gate)) * linear(x, w_up)  # (N, Ie)
    return linear(h, w_down)


class GroupedExperts(nn.Module):
    """``mlp.experts``: E SwiGLU experts packed as 3-D parameters (no ``.weight`` suffix).

    Sharded parameters (tensor parallelism splits Ie) are used through their local shards."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, impl: str = "auto") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.impl = impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted (N, H) grouped by expert, counts (E,) rows per expert → (N, H)."""
        return experts_forward(x_sorted, counts, local(self.gate_proj), local(self.up_proj), local(self.down_proj),
                               impl=self.impl)

    def extra_repr(self) -> str:
        E, ie, H = self.gate_proj.shape
        return f"experts={E}, hidden={H}, intermediate={ie}, impl={self.impl}"


# --- dispatch / combine -------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """rows = x[token_of_row]: each token copied once per chosen expert, in expert order.

    Backward gathers the k copies of each token back into (T, k, H) order and sums them, instead of
    autograd's scatter-add (index_put with accumulate), which is slow on CPU.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_row: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (inv,) = ctx.saved_tensors
        H = g.shape[-1]
        return g.index_select(0, inv).view(-1, ctx.k, H).sum(1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """y = x[idx] for a permutation idx; backward is the inverse permutation (a gather, not a scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None


def permute_rows(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a permutation ``idx`` whose inverse is ``inv`` (backward: a gather by ``inv``)."""
    return _PermuteRows.apply(x, idx, inv)


def routed_experts(x: torch.Tensor, routing: Routing, experts: nn.Module) -> torch.Tensor:
    """``Σ_slots w · expert(x)`` for x (T, H): sort the (token, slot) pairs by expert, run
    ``experts(x_sorted, counts)``, weight in sorted order, restore (token, slot) order and sum the k
    slots (transformers' grouped_mm order)."""
    T, k = routing.indices.shape
    E = experts.num_experts
    flat = routing.indices.reshape(-1)  # (T·k,) slot s of token t at t·k + s
    order = torch.argsort(flat, stable=True)  # sorted row j holds flat slot order[j]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    x_sorted = _GatherRows.apply(x, order // k, inv, k)
    y = experts(x_sorted, counts)  # (T·k, H)
    y = y * routing.weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    return _PermuteRows.apply(y, inv, order).view(T, k, -1).sum(1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """``mlp`` of a MoE decoder layer: routed experts, plus ``sigmoid(x·w_sg) · shared_expert(x)``
    when ``shared_expert_intermediate_size`` > 0 (Qwen3.5-MoE; Qwen3-VL-MoE has none).

    forward(x (..., H), token_mask=None) → (..., H). token_mask (same leading shape, nonzero =
    real token) only affects the router statistics this block publishes (padding left out).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_expert_intermediate_size: int = 0,
        *,
        experts_impl: str = "auto",
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.gate = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = GroupedExperts(num_experts, hidden_size, moe_intermediate_size, impl=experts_impl)
        self.shared_expert: SwiGLUMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = SwiGLUMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.route_key: str | None = None  # this block's name in route records (set by the trainer)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)  # (T, H)
        routing = self.gate(x)
        stats = router_stats(routing.probs, routing.indices, token_mask)
        _publish(stats)
        _note_routes(self.route_key, stats, routing, token_mask)
        out = routed_experts(x, routing, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)
