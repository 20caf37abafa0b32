"""Summed token cross-entropy over a plain (T, V) logits matrix, in row chunks.

``F.cross_entropy`` on a training step's logits writes a full (T, V) fp32 log-softmax in the
forward, and its backward zero-fills another (T, V) buffer for the NLL gradient before the
log-softmax backward reads both: on dense_small (2048 tokens x 32000 vocab) that is ~0.7 s of a
~5 s CPU step and ~0.5 GB. Here one pass over row chunks, in fp32 whatever the logits' dtype (bf16
logits are not copied to fp32 as a whole), forms each row's loss and, given the gradient the loss
is expected to get, writes the logits' gradient once (``softmax - onehot``, scaled) without keeping
the logits; without it the backward forms the gradient from the kept logits.
Vocab-sharded DTensor logits (loss parallel) keep PyTorch's path; see ``token_loss_sum``.

``linear_cross_entropy_sum`` goes one step further for an fp32 head (``train.fused_head_loss``):
the head's matmul runs inside the loss, chunk by chunk (~256 MB of fp32 logits), and each
chunk's logits become their gradient in place, so logits and gradient never both exist (the
unfused head holds both whole: 2 x 4 GB at a 248k vocabulary and 4096 tokens).

``compiled`` (``train.compile``, on CPU): each chunk's per-row passes run as one
``torch.compile``d kernel instead of eager passes: inductor fuses them into three row-wise sweeps
(max, exp-sum, gradient write), each row still in cache, and a 16-bit gradient is written straight
from fp32 registers. dense_small on 2 AMD cores: the bf16 logits' loss and gradient 69 -> 33 ms
of a profiled step, the fused fp32 head's element-wise work 46 -> 31 ms (alone). The same formula;
only the order of the sums differs (the loss within fp32 rounding, 16-bit gradients almost all
bitwise). Accelerators keep the eager passes over head-sized chunks (few launches, measured on an
H200); a compiled kernel there is unmeasured.
"""

from __future__ import annotations

import torch

from hyperpar.models.layers import onednn_gemm
from hyperpar.models.layers.compiled import compile_once
from hyperpar.unfilled import empty_unfilled

IGNORE_INDEX = -100


def _row_chunk(vocab: int, device: torch.device | None = None) -> int:
    # A CPU works through ~16 MB of fp32 at a time (the chunk's passes stay in cache); a GPU streams
    # from its memory anyway and pays per kernel launch instead: a head chunk's size (on an H200,
    # dense_small's fp32 step at 8 x 1024 tokens launched ~1000 kernels for 64-row blocks, ~50 ms of a
    # 0.15 s step).
    if device is not None and device.type != "cpu":
        return _head_rows(vocab, device)
    return max(1, (1 << 22) // max(vocab, 1))


def _loss_gradient_math(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient ``(softmax - onehot) * scale`` in x's dtype, each row's loss) of (rows, V) logits:
    ``_loss_and_gradient_``'s formula out of place, for inductor to fuse. Inductor keeps the exps
    in an fp32 buffer the size of ``x`` (recomputing them instead measured slower), so callers pass
    cache-sized row chunks, as to the eager passes."""
    xf = x.float()
    m = xf.amax(dim=-1, keepdim=True)
    e = (xf - m).exp()
    s = e.sum(dim=-1, keepdim=True)
    picked = xf.gather(1, safe) - m
    onehot = torch.arange(x.shape[1], device=x.device) == safe
    g = e * (scale[:, None] / s) - torch.where(onehot, scale[:, None], 0.0)
    return g.to(x.dtype), (s.log() - picked).squeeze(1)


def _loss_gradient_into(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each row's loss; the gradient written into ``out`` (which may be ``x`` itself)."""
    g, nll = _loss_gradient_math(x, safe, scale)
    out.copy_(g)
    return nll


def _rounded_loss_gradient_into(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                                dtype: torch.dtype) -> torch.Tensor:
    """``_loss_gradient_into`` for fp32 logits that stand for ``dtype`` ones (a 16-bit head's GEMM run
    in fp32): the logits rounded to ``dtype`` first, the gradient rounded to it on the way out (still
    stored in fp32), as the 16-bit logits and their 16-bit gradient would be."""
    g, nll = _loss_gradient_math(x.to(dtype), safe, scale)
    out.copy_(g)
    return nll


def _loss_only(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row's loss only (no backward follows): inductor drops the unused gradient."""
    return _loss_gradient_math(x, safe, scale)[1]


def _compiles(x: torch.Tensor, compiled: bool) -> bool:
    return compiled and x.device.type == "cpu"


def _compiled_rows(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None,
                   round_to: torch.dtype | None = None) -> torch.Tensor:
    """``_loss_and_gradient_`` for a chunk of rows through the compiled kernels: each row's loss and,
    with ``out``, its gradient written there. torch.compile's default shapes: the first chunk's
    static, the next row count (a ragged last chunk, another micro-batch size) recompiled once with
    the rows dynamic, which measured as fast (33 ms for dense_small's bf16 logits either way); no
    recompile per shape. ``round_to``: fp32 ``x`` standing for logits of that 16-bit dtype
    (:func:`_rounded_loss_gradient_into`; needs ``out``)."""
    if round_to is not None:
        # inductor drops a round trip through a 16-bit dtype unless told to keep it
        kernel = compile_once(_rounded_loss_gradient_into, options={"emulate_precision_casts": True})
        return kernel(x, safe, scale, out, round_to)
    if out is None:
        return compile_once(_loss_only)(x, safe, scale)
    return compile_once(_loss_gradient_into)(x, safe, scale, out)


def _loss_and_gradient_(x: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor, grad: bool) -> torch.Tensor:
    """Each row's loss ``lse - x[label]`` of an fp32 (rows, V) chunk of logits ``x``, which is
    overwritten: with ``grad``, by its gradient ``(softmax - onehot) * scale`` (scale: (rows,))."""
    m = x.amax(dim=-1, keepdim=True)
    x.sub_(m)
    picked = x.gather(1, safe)  # x[label] - max
    x.exp_()
    s = x.sum(dim=-1, keepdim=True)
    if grad:
        g = scale[:, None]
        x.mul_(g / s)  # softmax * scale
        x.scatter_add_(1, safe, -g)
    return (s.log() - picked).squeeze(1)


def _chunked_loss(logits: torch.Tensor, safe: torch.Tensor, scale: torch.Tensor,
                  out: torch.Tensor | None, compiled: bool = False) -> torch.Tensor:
    """Each row's loss over fp32 row chunks of ``logits`` (any float dtype); with ``out`` also the
    gradient ``(softmax - onehot) * scale`` written into it. The fp32 working chunk is the gradient's
    own rows for fp32 logits, else one reused buffer: never a fresh or type-promoted temporary per
    chunk (with train.fill_uninitialized_memory each of those is NaN-filled first, ~3.6 ms per 16 MB chunk on one
    CPU core). ``compiled``: each chunk through the compiled kernel instead of the eager passes."""
    T, V = logits.shape
    nll = torch.empty(T, dtype=torch.float32, device=logits.device)
    step = _row_chunk(V, logits.device)
    if _compiles(logits, compiled):
        for a in range(0, T, step):
            r = slice(a, a + step)
            nll[r] = _compiled_rows(logits[r], safe[r], scale[r], None if out is None else out[r])
        return nll
    buf = None
    if out is None or logits.dtype != torch.float32:
        buf = empty_unfilled((min(step, T), V), torch.float32, logits.device)
    for a in range(0, T, step):
        x = logits[a:a + step]
        p = out[a:a + step] if buf is None else buf[:x.shape[0]]
        nll[a:a + step] = _loss_and_gradient_(p.copy_(x), safe[a:a + step], scale[a:a + step], out is not None)
        if out is not None and buf is not None:
            out[a:a + step].copy_(p)
    return nll


def _hint_tensor(grad_hint: torch.Tensor | float, device: torch.device, who: str) -> torch.Tensor:
    """The expected upstream gradient as an fp32 scalar on ``device``; never zero (nothing could be
    rescaled from a zero gradient)."""
    hint = torch.as_tensor(grad_hint, dtype=torch.float32, device=device)
    if hint.device.type == "cpu" and float(hint) == 0.0:
        raise ValueError(f"{who}: grad_hint must be non-zero")
    return hint


def _rescale(grad: torch.Tensor, hint: torch.Tensor) -> torch.Tensor | None:
    """The factor a gradient formed for ``hint`` needs under the real upstream ``grad``; None when
    they are equal (multiplying by an exact 1 is skipped)."""
    return None if torch.equal(grad.float(), hint.float()) else grad.float() / hint.float()


class _CrossEntropySum(torch.autograd.Function):
    """Per row chunk: the fp32 loss and, when a backward follows and ``grad_hint`` is given, the
    gradient ``(softmax - onehot) * grad_hint`` formed in the same pass while the chunk is in cache
    (one read of the logits instead of two, one exp instead of two); the backward then only rescales
    it if the real upstream gradient is not ``grad_hint``. Without a hint the logits are kept and
    the backward forms the gradient (the memory of the old path: the gradient does not live from the
    forward to the backward next to logits the caller still holds)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, grad_hint: torch.Tensor | None,  # type: ignore[override]
                grads: bool, compiled: bool) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0).unsqueeze(1)
        # needs_input_grad reads True under no_grad too: the caller says whether a backward follows
        want = bool(ctx.needs_input_grad[0]) and grads
        ctx.formed = want and grad_hint is not None
        ctx.compiled = compiled
        if ctx.formed:
            scale = grad_hint.float() * valid.float()  # (T,): ignored rows get a zero gradient
            out = empty_unfilled(logits.shape, logits.dtype, logits.device)  # written whole
            nll = _chunked_loss(logits, safe, scale, out, compiled)
            ctx.save_for_backward(out, grad_hint)
        else:
            nll = _chunked_loss(logits, safe, valid.float(), None, compiled)
            if want:
                ctx.save_for_backward(logits, safe, valid)
        return (nll * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.formed:
            out, hint = ctx.saved_tensors
            ratio = _rescale(grad, hint)
            if ratio is not None:
                # exact for fp32 logits; 16-bit ones are rounded twice (at the hint's scale, then here)
                out = (out.float() * ratio).to(out.dtype)
            return out, None, None, None, None
        logits, safe, valid = ctx.saved_tensors
        out = empty_unfilled(logits.shape, logits.dtype, logits.device)
        _chunked_loss(logits, safe, grad.float() * valid.float(), out, ctx.compiled)
        return out, None, None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor,
                      grad_hint: torch.Tensor | float | None = None, *, compiled: bool = False) -> torch.Tensor:
    """Σ over rows of ``-log softmax(logits)[label]`` for (T, V) logits and (T,) labels, rows with
    label -100 left out; an fp32 scalar. Same value and gradient as
    ``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction='sum')``. With
    ``grad_hint`` (the gradient the loss will get, e.g. 1 / tokens) the gradient is formed in the
    forward and the logits are not kept: cheaper, but the (T, V) gradient then lives until the
    backward, so a caller that keeps the logits meanwhile (a pipeline stage's forward cache, a second
    loss) holds both. Another real gradient is still applied (one more pass; for 16-bit logits with
    a second rounding). ``compiled``: the passes as one compiled kernel (module docstring)."""
    hint = None if grad_hint is None else _hint_tensor(grad_hint, logits.device, "cross_entropy_sum")
    return _CrossEntropySum.apply(logits, labels, hint, torch.is_grad_enabled(), compiled)


# --- the head's matmul and the cross-entropy in one pass over row chunks ------------------------------

def _head_rows(vocab: int, device: torch.device) -> int:
    # ~256 MB of fp32 logits per chunk (the one working buffer), at least 256 rows. Each chunk streams
    # the weight and its gradient again, and the head's GEMMs are faster on more rows: on 2 AMD cores
    # (dense_small's 32000 x 512 head) one 2048-row chunk took 1078 ms for its three GEMMs where two
    # 1048-row chunks took 1210.
    return max(256, (1 << 26) // max(vocab, 1))


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` through the process's fp32 GEMM policy (``launch.cpu_gemm``). oneDNN returns a
    tensor of its own (``out`` is then left alone: a copy into it would cost a pass); the BLAS
    writes into ``out``."""
    if onednn_gemm.applies(a, b.t(), None):
        return onednn_gemm.mm(a, b)
    return torch.mm(a, b, out=out)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Σ CE of ``hidden @ weight.T`` without the (T, V) logits: per chunk of rows the logits are
    formed, reduced to their loss and turned into their gradient (``softmax - onehot``, times the
    expected upstream gradient ``grad_hint``) in place, while still in cache, and both input
    gradients are accumulated in the forward. The backward only rescales them if the real upstream
    gradient is not ``grad_hint`` (multiplying by an exact 1 is skipped).

    16-bit ``hidden`` and ``weight`` (a CPU whose 16-bit matmuls run as fp32 GEMMs,
    ``train.mixed_precision.cpu_matmul``): the GEMMs run in fp32 on the 16-bit values, and the
    logits, their gradient and both input gradients are rounded to 16 bits where the unfused head
    (16-bit logits, 16-bit gradient) rounds them; the weight's gradient is summed over the chunks in
    fp32 and rounded once."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                grad_hint: torch.Tensor, grads: bool, compiled: bool) -> torch.Tensor:
        T, V = hidden.shape[0], weight.shape[0]
        half = hidden.dtype if hidden.dtype != torch.float32 else None  # the dtype the logits stand for
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0).unsqueeze(1)
        # needs_input_grad reads True under no_grad too: the caller says whether a backward follows
        want_h, want_w = (bool(ctx.needs_input_grad[i]) and grads for i in (0, 1))
        form_grad = want_h or want_w  # the chunks' logits become their gradient
        scale = grad_hint.float() * valid.float()  # (T,): ignored rows get a zero gradient
        nll = torch.empty(T, dtype=torch.float32, device=hidden.device)
        step = _head_rows(V, hidden.device)
        w32 = weight.float()  # the weight itself in fp32
        dh = None  # fp32, one chunk: the GEMM's own output; several (or 16-bit): written chunk by chunk
        if want_h and (T == 0 or T > step or half):
            dh = torch.zeros_like(hidden) if T == 0 else empty_unfilled(hidden.shape, hidden.dtype, hidden.device)
        dw = None  # the first chunk writes it whole, the others accumulate (16-bit: in fp32, rounded at the end)
        if want_w:
            dw = torch.zeros_like(w32) if T == 0 else empty_unfilled(w32.shape, torch.float32, weight.device)
        wt = w32.t()
        buf = None  # the BLAS's logits chunk, reused (oneDNN hands back one of its own)
        for a in range(0, T, step):
            h = hidden[a:a + step].float()
            if a == 0 and not onednn_gemm.applies(h, w32, None):
                buf = empty_unfilled((h.shape[0], V), torch.float32, hidden.device)
            p = _mm(h, wt, out=None if buf is None else buf[:h.shape[0]])  # the logits, turned in place into
            # their gradient below, on a CPU a cache-sized block of rows at a time (the GEMMs want the
            # whole chunk): 2048 x 32000 on 2 AMD cores, 44 ms in 64-row blocks against 92 ms whole;
            # compiled, in blocks the size of the kernel's own fp32 buffer of exps
            comp = _compiles(p, compiled)
            blk = max(1, _row_chunk(V) // (1 if comp else 2)) if h.device.type == "cpu" else h.shape[0]
            for b in range(0, h.shape[0], blk):
                rows = slice(a + b, a + min(b + blk, h.shape[0]))
                x = p[b:b + blk]
                if comp and half and form_grad:
                    nll[rows] = _compiled_rows(x, safe[rows], scale[rows], x, round_to=half)
                    continue
                if half:  # the 16-bit logits' values
                    x.copy_(x.to(half))
                if comp:
                    nll[rows] = _compiled_rows(x, safe[rows], scale[rows], x if form_grad else None)
                else:
                    nll[rows] = _loss_and_gradient_(x, safe[rows], scale[rows], form_grad)
                    if half and form_grad:  # the 16-bit gradient's values
                        x.copy_(x.to(half))
            if form_grad:
                if want_h and dh is None:
                    dh = _mm(p, w32)
                elif want_h:
                    dh_rows = dh[a:a + step]
                    y = _mm(p, w32, out=None if half else dh_rows)
                    if y.data_ptr() != dh_rows.data_ptr():
                        dh_rows.copy_(y)
                if want_w and onednn_gemm.applies(h.t(), p.t(), None):
                    # (hᵀ p)ᵀ: oneDNN reads p transposed as its weight, where pᵀ as its input was first
                    # copied whole, (V x rows) per chunk: 205 against 291 ms per 1048-row chunk of a
                    # 32000 x 512 head on 2 AMD cores (MKL's pᵀ h: 188)
                    part = onednn_gemm.mm(h.t(), p)
                    onednn_gemm.transposed_copy(part, out=dw, add=a > 0)  # in row blocks: faster
                elif want_w and a == 0:
                    torch.mm(p.t(), h, out=dw)
                elif want_w:
                    dw.addmm_(p.t(), h)
            p = part = None  # freed before the next chunk's logits GEMM allocates its own
        if half and dw is not None:
            dw = dw.to(half)
        ctx.save_for_backward(dh, dw, grad_hint)
        return (nll * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dh, dw, hint = ctx.saved_tensors
        ratio = _rescale(grad, hint)
        if ratio is not None:
            dh = dh * ratio if dh is not None else None
            dw = dw * ratio if dw is not None else None
        return dh, dw, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             grad_hint: torch.Tensor | float = 1.0, *, compiled: bool = False) -> torch.Tensor:
    """``cross_entropy_sum(hidden @ weight.T, labels)`` for (T, H) ``hidden`` and a (V, H) head
    ``weight``, never holding the (T, V) logits or their gradient: both gradients are computed in
    the forward, chunk by chunk. ``grad_hint``: the gradient the loss will get in backward (e.g.
    1 / tokens); any other gradient is still exact, at one more pass over the weight gradient.
    ``compiled``: each chunk's loss and gradient as one compiled kernel (module docstring)."""
    hint = _hint_tensor(grad_hint, hidden.device, "linear_cross_entropy_sum")
    return _LinearCrossEntropySum.apply(hidden, weight, labels, hint, torch.is_grad_enabled(), compiled)
