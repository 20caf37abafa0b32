"""GatedDeltaNet (Qwen3.5 linear attention, MODELS.md 5) in plain PyTorch.

``chunk_gated_delta_rule`` is the chunked (WY / UT-transform) form of the gated delta rule,
written for CPU/NPU training where no Triton kernel exists: everything that does not depend on the
carried state is computed for all chunks at once, and the sequential part per chunk is three small
batched matmuls on the carried state (its read by the chunk's queries, W S, the state update).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.compiled import compile_once
from hyperpar.models.layers.cpu_matmul import Linear
from hyperpar.models.layers.documents import Documents
from hyperpar.models.layers.local import local
from hyperpar.models.layers.norms import GatedRMSNorm


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x · rsqrt(Σx² + eps)`` over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class _CausalConvSilu(torch.autograd.Function):
    """Causal depthwise conv (+ optional silu) with a hand-written backward.

    Autograd of the shifted multiply-add form zero-fills a padded gradient per tap and keeps K
    products alive; here every tap accumulates in place into one buffer, forward and backward,
    which halves the memory traffic of this (memory-bound) op.

    With packed documents, ``fixups`` = (tokens, src, valid) from ``Documents.conv_fixups``: the
    few tokens whose window crosses a document start are recomputed from their in-document taps
    only (forward), and their gradient is kept out of the shifted passes and added back through
    those taps alone (backward). Exact, and the full-size passes stay as they are.

    ``fused`` (16-bit tensors under ``train.compile``, no packed documents): forward and backward each
    run as one compiled kernel, the taps summed in fp32 and rounded once (see ``_fused_conv``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, silu: bool, fixups=None,  # type: ignore[override]
                fused: bool = False) -> torch.Tensor:
        ctx.silu = silu
        ctx.fixups = fixups
        ctx.fused = fused
        if fused:  # the compiled kernels take the weight tap-major (K, C); saved so for the backward
            wt = w.t().contiguous()
            y, out = _fused_conv("forward")(x, wt, silu)
            ctx.save_for_backward(x, wt, y)
            return out
        # x: (B, S, C) contiguous; w: (C, K). Tap i reads x shifted right by K−1−i.
        K, S = w.shape[1], x.shape[1]
        y = x * w[:, K - 1]
        for s in range(1, min(K, S)):
            y[:, s:].addcmul_(x[:, : S - s], w[:, K - 1 - s])
        if fixups is not None:
            tokens, src, valid = fixups
            C = x.shape[-1]
            taps = x.view(-1, C)[src] * valid.unsqueeze(-1)  # (P, K, C): in-document inputs only
            y.view(-1, C).index_copy_(0, tokens, (taps * w.t()).sum(1))
        ctx.save_for_backward(x, w, y)
        return F.silu(y) if silu else y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if ctx.fused:  # w is the tap-major (K, C) weight here
            dx, dwt = _fused_conv("backward")(grad_out, x, w, y, ctx.silu)
            dw = dwt.t().contiguous() if ctx.needs_input_grad[1] else None
            return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None
        K, S = w.shape[1], x.shape[1]
        dy = torch.ops.aten.silu_backward(grad_out, y) if ctx.silu else grad_out
        fixed = None
        if ctx.fixups is not None:
            tokens, src, valid = ctx.fixups
            C = x.shape[-1]
            fixed = dy.view(-1, C)[tokens]  # (P, C): gradient of the recomputed tokens
            dy = dy.clone() if dy is grad_out else dy
            dy.view(-1, C).index_fill_(0, tokens, 0.0)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dy * w[:, K - 1]
            for s in range(1, min(K, S)):
                dx[:, : S - s].addcmul_(dy[:, s:], w[:, K - 1 - s])
            if fixed is not None:
                per_tap = (fixed.unsqueeze(1) * w.t()) * valid.unsqueeze(-1)  # (P, K, C)
                dx.view(-1, C).index_add_(0, src.reshape(-1), per_tap.reshape(-1, C))
        if ctx.needs_input_grad[1]:
            cols = [(dy * x).sum((0, 1))]  # tap K−1 (no shift)
            for s in range(1, K):
                cols.append((dy[:, s:] * x[:, : S - s]).sum((0, 1)) if s < S else torch.zeros_like(cols[0]))
            dw = torch.stack(cols[::-1], dim=1)  # (C, K): column i is the tap with shift K−1−i
            if fixed is not None:
                taps = x.view(-1, C)[src] * valid.unsqueeze(-1)  # (P, K, C)
                dw = dw + torch.einsum("pc,pkc->ck", fixed, taps)
        return dx, dw, None, None, None


def _conv_forward(x: torch.Tensor, wt: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv's taps summed in fp32, rounded once to x's dtype; (pre-activation, output).

    Shaped for inductor: ``wt`` is the weight tap-major, (K, C) contiguous, so a tap's weights are
    a row it loads as a vector (from the (C, K) layout they are a stride-K gather and the kernel
    stays scalar: 2-3x slower); every tap reads one left-padded copy of x over the same range."""
    K, S = wt.shape[0], x.shape[1]
    xp, wf = F.pad(x.float(), (0, 0, K - 1, 0)), wt.float()
    acc = xp[:, K - 1:] * wf[K - 1]
    for s in range(1, K):  # tap K-1-s reads x shifted right by s
        acc = acc + xp[:, K - 1 - s:K - 1 - s + S] * wf[K - 1 - s]
    y = acc.to(x.dtype)
    return y, (F.silu(y) if silu else y)


_CONV_W_ROWS = 64  # rows per partial weight-gradient sum (64 x 1024 channels x fp32: 256 KB an operand)


def _conv_backward(grad_out: torch.Tensor, x: torch.Tensor, wt: torch.Tensor, y: torch.Tensor,
                   silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dwt): the input's gradient and the weight's, tap-major (K, C) as ``wt``. The K weight
    sums run over one range (the padded x), so inductor makes them one pass with K accumulators
    (over K slices of different lengths they were K passes). Each sum runs over blocks of
    ``_CONV_W_ROWS`` rows first, then over the blocks: summed down whole columns, inductor's loop
    strode 4 KB (a row) per load through every (B·S, C) operand; per block it stays in cache.
    (2, 1024, 1024) on 2 AMD cores, median backward: fp32 5.8-6.4 -> 3.9-4.8 ms, bf16 3.0-3.9 -> 2.5-3.0."""
    K, S = wt.shape[0], x.shape[1]
    dy = (torch.ops.aten.silu_backward(grad_out, y) if silu else grad_out).float()
    wf = wt.float()
    dp = F.pad(dy, (0, 0, 0, K - 1))
    dx = dy * wf[K - 1]
    for s in range(1, K):
        dx = dx + dp[:, s:s + S] * wf[K - 1 - s]
    xp = F.pad(x.float(), (0, 0, K - 1, 0))
    T, C, R = x.shape[0] * S, x.shape[2], _CONV_W_ROWS
    blocks = -(-T // R)

    def column_sums(t: torch.Tensor) -> torch.Tensor:  # (B, S, C) -> (blocks, C); zero rows pad the last
        t = t.reshape(T, C)
        return (F.pad(t, (0, 0, 0, blocks * R - T)) if blocks * R > T else t).view(blocks, R, C).sum(1)

    dwt = torch.stack([column_sums(dy * xp[:, k:k + S]) for k in range(K)], dim=0).sum(1)
    return dx.to(x.dtype), dwt.to(wt.dtype)


_FUSED_CONV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_conv(which: str):
    """The conv's forward or backward through ``torch.compile`` (one graph per shape). Eager, a 16-bit
    multiply-add is several ops over the whole tensor, each converting to fp32 and back, and even the
    in-place fp32 taps are K passes each way; compiled, the forward is one pass and the backward two
    (dx, then the K weight sums together). (2, 1024, 512) forward and backward on 2 AMD cores: bf16
    8.9 ms eager, 2.4 compiled; fp32 5.8 eager, 3.5 compiled."""
    return compile_once(_conv_forward if which == "forward" else _conv_backward, dynamic=False)


def causal_depthwise_conv1d(
    x: torch.Tensor, weight: torch.Tensor, *, silu: bool = True, doc: Documents | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Causal depthwise conv over time, no bias: ``u[t, c] = Σ_i w[c, 0, i] · x[t − (K−1) + i, c]``,
    inputs before the start of t's document (``doc``; else of its row) counting as zero.

    x: (B, S, C); weight: (C, 1, K) (the nn.Conv1d layout of the checkpoint) or (C, K). Computed in the
    weight's dtype, then silu (if asked), then cast to x's dtype (as transformers does). Written as
    K shifted multiply-adds in the (B, S, C) layout: for K = 4 this is several times faster on CPU
    than a grouped ``F.conv1d`` (which also needs two transposes). (Accumulating 16-bit taps in
    fp32 is faster on CPU, but moves the bf16 rounding enough to flip a near-tied MoE route
    against transformers' bf16 model: tests/test_qwen3_5_moe_parity.py.) ``compiled``
    (``train.compile``): fp32 and 16-bit tensors without packed documents take compiled kernels
    (``_fused_conv``), which sum 16-bit taps in fp32 (rounded once, as a compiled block rounds its fused
    element-wise work).
    """
    w = weight.view(weight.shape[0], weight.shape[-1])
    fixups = doc.conv_fixups(w.shape[1]) if doc is not None else None
    xw = x.to(w.dtype).contiguous()
    fused = compiled and fixups is None and w.dtype in _FUSED_CONV_DTYPES and xw.shape[1] > 0
    y = _CausalConvSilu.apply(xw, w, silu, fixups, fused)
    return y.to(x.dtype)


class _UnitLowerInverse(torch.autograd.Function):
    """``T = A⁻¹`` for a batch of unit lower-triangular ``A`` (only the strict lower triangle is read;
    the diagonal counts as 1). The backward reuses ``T``: ``dA = −(Tᵀ dT Tᵀ)`` on the strict lower
    triangle, two batched matmuls where autograd's ``solve_triangular`` backward runs a second
    triangular solve: on 2 AMD cores the solve of 512 blocks of 32 x 32 takes ~3 ms, a 32 x 32 x 32
    batched matmul ~0.5."""

    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        t = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (t,) = ctx.saved_tensors
        tt = t.transpose(-1, -2)
        return -(tt @ grad @ tt).tril(-1)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule over a whole sequence, state starting at zero (MODELS.md 5.3, 5.4).

    q, k: (B, S, nk, dk); v: (B, S, nv, dv); g (log decay, ≤ 0), beta: (B, S, nv); nv a multiple
    of nk with value head j reading key head j // (nv/nk). Returns o: (B, S, nv, dv) in v's dtype.
    All arithmetic is fp32. Any S ≥ 1 works: the tail is zero-padded to a whole chunk (padding has
    g = 0, k = v = 0, beta = 0 and so changes nothing).

    segment_ids (B, S), non-decreasing along each row: packed documents, the state restarting at
    zero where the id changes. Inside a chunk the decay matrix is cut to same-document pairs (so
    the UT transform is block-diagonal), only tokens of the document the chunk continues read the
    carried state, only the chunk's last document writes it, and a chunk holding a start passes no
    old state on. All of it is masking of finite values: no −inf decays, no NaNs.
    """
    B, S, nk, dk = k.shape
    nv, dv = v.shape[-2:]
    if nv % nk:
        raise ValueError(f"value heads {nv} must be a multiple of key heads {nk}")
    r = nv // nk
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)

    C = chunk_size
    pad = (-S) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    N = (S + pad) // C
    if segment_ids is not None:
        seg = segment_ids.to(q.device)
        if pad:  # the padding joins the row's last document (it contributes nothing anyway)
            seg = torch.cat([seg, seg[:, -1:].expand(B, pad)], dim=1)
        segc = seg.view(B, N, C).permute(1, 0, 2)  # (N, B, C)
        # document of the state entering each chunk: that of the token just before it
        entering = torch.cat([segc[:1, :, :1], segc[:-1, :, -1:]], dim=0)  # (N, B, 1)
        reads_state = (segc == entering)[:, :, None, None, :]  # (N, B, 1, 1, C)
        writes_state = (segc == segc[..., -1:])[:, :, None, None, :]
        same_doc = (segc.unsqueeze(-1) == segc.unsqueeze(-2))[:, :, None, None]  # (N, B, 1, 1, C, C)

    # Chunk-major layouts: leading (N, B, heads) dims are plain batch dims for every matmul, and the
    # per-chunk slices in the scan below are contiguous. Value heads are split (nk, r) so key-side
    # products are computed once per key head and broadcast over its r value heads.
    qc = q.view(B, N, C, nk, dk).permute(1, 0, 3, 2, 4).contiguous()  # (N, B, nk, C, dk)
    kc = k.view(B, N, C, nk, dk).permute(1, 0, 3, 2, 4).contiguous()  # (N, B, nk, C, dk)
    vc = v.view(B, N, C, nk, r, dv).permute(1, 0, 3, 4, 2, 5)  # (N, B, nk, r, C, dv)
    gc = g.view(B, N, C, nk, r).permute(1, 0, 3, 4, 2)  # (N, B, nk, r, C)
    bc = beta.view(B, N, C, nk, r).permute(1, 0, 3, 4, 2)  # (N, B, nk, r, C)

    gamma = gc.cumsum(-1)  # log decay from the chunk start, inclusive
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # Γ_ij = exp(γ_i − γ_j) for j ≤ i, else 0 (masked before exp so nothing overflows)
    cut = upper if segment_ids is None else upper | ~same_doc
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(cut, float("-inf")).exp()  # (N,B,nk,r,C,C)
    kkt = kc @ kc.transpose(-1, -2)  # (N, B, nk, C, C)
    qkt = qc @ kc.transpose(-1, -2)
    # A = I + strict_lower(diag(β) K Kᵀ ⊙ Γ); the solve below treats the diagonal as 1.
    a_mat = kkt.unsqueeze(3) * decay * bc.unsqueeze(-1)  # (N, B, nk, r, C, C)
    attn = qkt.unsqueeze(3) * decay  # intra-chunk attention incl. the diagonal
    eg = gamma.exp()  # (N, B, nk, r, C)
    if segment_ids is not None:
        eg = eg * reads_state
    # T = A⁻¹ once (C right-hand sides), then U = T βV and W = T (βK ⊙ e^γ) as matmuls: cheaper on
    # CPU than solving for the dv + dk columns directly, forward and backward.
    t_mat = _UnitLowerInverse.apply(a_mat)
    BH = B * nv
    t_mat = t_mat.reshape(N, BH, C, C)
    u_all = t_mat @ (vc * bc.unsqueeze(-1)).reshape(N, BH, C, dv)  # (N, BH, C, dv)
    w_all = t_mat @ (kc.unsqueeze(3) * (bc * eg).unsqueeze(-1)).reshape(N, BH, C, dk)  # (N, BH, C, dk)
    q_dec = qc.unsqueeze(3) * eg.unsqueeze(-1)  # Q ⊙ e^γ: reads the state entering the chunk
    k_dec = kc.unsqueeze(3) * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # K ⊙ e^(γ_C − γ)
    chunk_decay = gamma[..., -1].exp()  # (N, B, nk, r)
    if segment_ids is not None:
        k_dec = k_dec * writes_state.unsqueeze(-1)
        chunk_decay = chunk_decay * reads_state[..., -1]  # 0 when a document starts in the chunk
    k_dec = k_dec.reshape(N, BH, C, dk)
    chunk_decay = chunk_decay.reshape(N, BH, 1, 1)

    # Sequential scan over chunks: only the state S (BH, dk, dv) is carried. unbind() gives one
    # autograd node for all slices (indexing per step would zero-fill a full-size gradient each time).
    u_l, w_l, kd_l, cd_l = u_all.unbind(0), w_all.unbind(0), k_dec.unbind(0), chunk_decay.unbind(0)
    qd_l = q_dec.reshape(N, BH, C, dk).unbind(0)
    state = torch.zeros(BH, dk, dv, dtype=torch.float32, device=q.device)
    reads, new_vals = [], []
    for i in range(N):
        # (Q ⊙ e^γ) S: the state read while it is in cache (as one batched matmul over all chunks,
        # the stacked states are streamed from memory: slower on CPU, forward and backward)
        reads.append(torch.zeros_like(u_l[0]) if i == 0 else torch.bmm(qd_l[i], state))
        v_new = u_l[i] if i == 0 else torch.baddbmm(u_l[i], w_l[i], state, alpha=-1)  # U − W S
        new_vals.append(v_new)
        if i + 1 < N:
            state = torch.baddbmm(state * cd_l[i], kd_l[i].transpose(-1, -2), v_new)
    vn_all = torch.stack(new_vals)  # (N, BH, C, dv)

    # O = (Q ⊙ e^γ) S + (QKᵀ ⊙ Γ) V', the second batched over all chunks
    o = torch.stack(reads) + attn.reshape(N, BH, C, C) @ vn_all  # (N, BH, C, dv)
    o = o.view(N, B, nv, C, dv).permute(1, 0, 3, 2, 4).reshape(B, N * C, nv, dv)
    return o[:, :S].to(out_dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token reference of the same recurrence (slow; for tests and decoding).

    ``S_t = α_t S_{t−1} + k̂_t ⊗ β_t (v_t − α_t S_{t−1}ᵀ k̂_t)``, ``o_t = S_tᵀ q̂_t``. Shapes as above;
    with ``segment_ids`` the state is zeroed before every token whose id differs from the previous one.
    """
    B, S, nk, dk = k.shape
    nv, dv = v.shape[-2:]
    r = nv // nk
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)
    q = q.repeat_interleave(r, dim=2)
    k = k.repeat_interleave(r, dim=2)
    state = torch.zeros(B, nv, dk, dv, dtype=torch.float32, device=q.device)
    outs = []
    for t in range(S):
        state = state * g[:, t].exp()[..., None, None]
        if segment_ids is not None and t > 0:
            keep = (segment_ids[:, t] == segment_ids[:, t - 1]).to(state.dtype)  # (B,)
            state = state * keep[:, None, None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1).to(out_dtype)


def compiled_chunk_gated_delta_rule():
    """``chunk_gated_delta_rule`` through ``torch.compile`` (one graph per input shape and document
    mode; the chunk scan unrolls into it). Inductor fuses the element-wise work between the batched
    matmuls: about half the eager time of the rule on CPU (docs/guide/performance.md)."""
    return compile_once(chunk_gated_delta_rule, dynamic=False)


def delta_rule_macs_per_token(num_value_heads: int, key_dim: int, value_dim: int, chunk: int = 64) -> float:
    """Forward multiply-adds per token of the chunked rule (the model FLOP count's share of it): per
    value head, K Kᵀ and Q Kᵀ (2·C·dk), the triangular solve for U and W (C·(dk+dv)/2), the
    intra-chunk attention times V' (C·dv) and the three state products W S, Q S, Kᵀ V' (3·dk·dv)."""
    C, dk, dv = chunk, key_dim, value_dim
    return num_value_heads * (2 * C * dk + C * (dk + dv) / 2 + C * dv + 3 * dk * dv)


def default_chunk_size(device: torch.device) -> int:
    """The delta rule's chunk where the model leaves it open. CPU: 32, the fastest for dk = dv = 64…128
    (the C² intra-chunk work halves while the scan stays short). Accelerators: 64 (transformers' and
    flash-linear-attention's), since there the step waits on the host launching the scan's per-chunk
    matmuls and a longer chunk halves their count."""
    return 32 if device.type == "cpu" else 64


class GatedDeltaRule(nn.Module):
    """The GatedDeltaNet recurrence as a module: causal depthwise conv + silu on the projected q, k, v,
    then the chunked gated delta rule. No parameters of its own (the conv weights come in as
    arguments), so a parallelizer can wrap it (context parallel: all-to-all to head-sharded full
    sequences around it) and a GPU build can swap in a fused kernel, without touching the block.

    q, k: (B, S, nk, dk) and v: (B, S, nv, dv) before the conv; g, beta: (B, S, nv);
    conv_q/k/v: (channels, K) depthwise weights for the flattened heads. Returns o (B, S, nv, dv).
    Heads are independent, so any head-sharded slice of the inputs gives that slice of the output.
    ``doc`` (packed documents, per token): neither the conv nor the state crosses a document start.
    """

    def __init__(self, chunk_size: int | None = None) -> None:
        super().__init__()
        self.chunk_size = chunk_size  # None: per device, ``default_chunk_size``
        self.compiled = False  # train.compile: the chunked rule runs as its own compiled graph

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_q: torch.Tensor,
        conv_k: torch.Tensor,
        conv_v: torch.Tensor,
        *,
        doc: Documents | None = None,
    ) -> torch.Tensor:
        B, S = q.shape[:2]
        q, k, v = (
            causal_depthwise_conv1d(t.reshape(B, S, -1), w, silu=True, doc=doc, compiled=self.compiled).view(t.shape)
            for t, w in ((q, conv_q), (k, conv_k), (v, conv_v))
        )
        seg = doc.segment_ids if doc is not None else None
        rule = compiled_chunk_gated_delta_rule() if self.compiled else chunk_gated_delta_rule
        chunk = self.chunk_size or default_chunk_size(q.device)
        return rule(q, k, v, g, beta, chunk, segment_ids=seg)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size or 'auto'}" + (", compiled" if self.compiled else "")


class GatedDeltaNet(nn.Module):
    """Qwen3.5 ``linear_attn`` block (MODELS.md 5.1).

    x (B, S, H) → q/k/v projections → causal conv + silu → gated delta rule with decay
    ``g = −exp(A_log) · softplus(a + dt_bias)`` and ``β = sigmoid(b)`` → gated RMSNorm with
    z → out_proj.

    The checkpoint fuses the q, k and v projections (``in_proj_qkv``, rows [Q; K; V]) and their
    depthwise conv (``conv1d``); here each is its own parameter (``in_proj_q/k/v``,
    ``conv1d_q/k/v``) so tensor parallelism can shard all three by heads with a plain row split
    (a row split of the fused weight would give rank 0 all of Q). The HF adapter fuses and
    unfuses them, so checkpoints in and out keep the released layout.

    ``chunk_size`` only changes fp32 rounding (the result is exact for any size); None picks it per
    device at run time (``default_chunk_size``: 32 on CPU, which also rounds slightly better than
    transformers' 64; 64 on a GPU).
    """

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int = 4,
        *,
        eps: float = 1e-6,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear value heads {num_value_heads} not a multiple of key heads {num_key_heads}")
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        key_dim = num_key_heads * key_head_dim
        value_dim = num_value_heads * value_head_dim
        self.in_proj_q = Linear(hidden_size, key_dim, bias=False)
        self.in_proj_k = Linear(hidden_size, key_dim, bias=False)
        self.in_proj_v = Linear(hidden_size, value_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, num_value_heads, bias=False)
        K = conv_kernel_size
        self.conv1d_q = nn.Conv1d(key_dim, key_dim, K, groups=key_dim, bias=False)
        self.conv1d_k = nn.Conv1d(key_dim, key_dim, K, groups=key_dim, bias=False)
        self.conv1d_v = nn.Conv1d(value_dim, value_dim, K, groups=value_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads).uniform_(0.01, 16).log_())
        self.recurrence = GatedDeltaRule(chunk_size)
        self.norm = GatedRMSNorm(value_head_dim, eps)
        self.out_proj = Linear(value_dim, hidden_size, bias=False)

    @property
    def chunk_size(self) -> int | None:
        """The rule's chunk; None: picked per device when the layer runs (``default_chunk_size``)."""
        return self.recurrence.chunk_size

    def forward(self, x: torch.Tensor, *, doc: Documents | None = None) -> torch.Tensor:
        B, S = x.shape[:2]
        dk, dv = self.key_head_dim, self.value_head_dim
        # Head counts from the activations (-1), not the module config: a head-sharded (TP) layer
        # holds fewer heads and works unchanged; its sharded parameters are used through local().
        q = self.in_proj_q(x).view(B, S, -1, dk)
        k = self.in_proj_k(x).view(B, S, -1, dk)
        v = self.in_proj_v(x).view(B, S, -1, dv)
        b = self.in_proj_b(x)  # (B, S, nv)
        beta = torch.sigmoid(b)  # activation dtype, as transformers
        a_log, dt_bias = local(self.A_log), local(self.dt_bias)
        g = -a_log.float().exp() * F.softplus(self.in_proj_a(x).float() + dt_bias)  # fp32, ≤ 0
        convs = (local(c.weight) for c in (self.conv1d_q, self.conv1d_k, self.conv1d_v))
        o = self.recurrence(q, k, v, g, beta, *convs, doc=doc)  # (B, S, nv, dv)
        z = self.in_proj_z(x).view(B, S, -1, dv)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, S, -1))
