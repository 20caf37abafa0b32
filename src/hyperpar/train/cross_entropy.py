"""Summed token cross-entropy over a plain (T, V) logits matrix, in row chunks.

``F.cross_entropy`` on a training step's logits writes a full (T, V) fp32 log-softmax in the
forward, and its backward zero-fills another (T, V) buffer for the NLL gradient before the
log-softmax backward reads both: on dense_small (2048 tokens x 32000 vocab) that is ~0.7 s of a
~5 s CPU step and ~0.5 GB. Here one pass over row chunks, in fp32 whatever the logits' dtype (bf16
logits are not copied to fp32 as a whole), forms each row's loss and writes its gradient once,
``softmax - onehot`` scaled by the gradient the loss is expected to get; the logits are not kept
for the backward.
Vocab-sharded DTensor logits (loss parallel) keep PyTorch's path; see ``token_loss_sum``.

``linear_cross_entropy_sum`` goes one step further for an fp32 head (``train.fused_head_loss``):
the head's matmul runs inside the loss, chunk by chunk (up to 256 MB of fp32 logits), and each
chunk's logits become their gradient in place, so logits and gradient never both exist (the
unfused head holds both whole: 2 x 4 GB at a 248k vocabulary and 4096 tokens).
"""

from __future__ import annotations

import torch

from hyperpar.models.layers import onednn_gemm
from hyperpar.unfilled import empty_unfilled

IGNORE_INDEX = -100


def _row_chunk(vocab: int) -> int:
    return max(1, (1 << 22) // max(vocab, 1))  # ~16 MB of fp32 per chunk


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


class _CrossEntropySum(torch.autograd.Function):
    """Per row chunk: the fp32 log-sum-exp and, when a backward follows, the gradient
    ``(softmax - onehot) * grad_hint`` formed in the same pass while the chunk is in cache (one read
    of the logits instead of two, one exp instead of two). The backward only rescales the saved
    gradient if the real upstream gradient is not ``grad_hint``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, grad_hint: torch.Tensor,  # type: ignore[override]
                grads: bool) -> torch.Tensor:
        T, V = logits.shape
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0).unsqueeze(1)
        # needs_input_grad reads True under no_grad too: the caller says whether a backward follows
        want = bool(ctx.needs_input_grad[0]) and grads
        scale = grad_hint.float() * valid.float()  # (T,): ignored rows get a zero gradient
        nll = torch.empty(T, dtype=torch.float32, device=logits.device)
        fp32 = logits.dtype == torch.float32
        out = empty_unfilled(logits.shape, logits.dtype, logits.device) if want else None  # written whole
        step = _row_chunk(V)
        # the fp32 working chunk: for fp32 logits with a gradient, the gradient's own rows; else one
        # reused buffer (never a fresh or type-promoted temporary per chunk: under train.deterministic
        # each of those is NaN-filled first, ~3.6 ms per 16 MB chunk on one CPU core)
        buf = None if fp32 and want else empty_unfilled((min(step, T), V), torch.float32, logits.device)
        for a in range(0, T, step):
            x = logits[a:a + step]
            p = out[a:a + step] if buf is None else buf[:x.shape[0]]
            nll[a:a + step] = _loss_and_gradient_(p.copy_(x), safe[a:a + step], scale[a:a + step], want)
            if want and buf is not None:
                out[a:a + step].copy_(p)
        ctx.save_for_backward(out, grad_hint)
        return (nll * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out, hint = ctx.saved_tensors
        if out is not None and not torch.equal(grad.float(), hint.float()):
            out = (out.float() * (grad.float() / hint.float())).to(out.dtype)
        return out, None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor,
                      grad_hint: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Σ over rows of ``-log softmax(logits)[label]`` for (T, V) logits and (T,) labels, rows with
    label -100 left out; an fp32 scalar. Same value and gradient as
    ``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction='sum')``. The gradient
    is formed in the forward for the upstream gradient ``grad_hint`` (e.g. 1 / tokens); any other is
    still exact, at one more pass over the gradient in backward."""
    hint = torch.as_tensor(grad_hint, dtype=torch.float32, device=logits.device)
    if hint.device.type == "cpu" and float(hint) == 0.0:  # nothing could be rescaled from a zero gradient
        raise ValueError("cross_entropy_sum: grad_hint must be non-zero")
    return _CrossEntropySum.apply(logits, labels, hint, torch.is_grad_enabled())


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
    gradient is not ``grad_hint`` (multiplying by an exact 1 is skipped)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                grad_hint: torch.Tensor, grads: bool) -> torch.Tensor:
        T, V = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0).unsqueeze(1)
        # needs_input_grad reads True under no_grad too: the caller says whether a backward follows
        want_h, want_w = (bool(ctx.needs_input_grad[i]) and grads for i in (0, 1))
        scale = grad_hint.float() * valid.float()  # (T,): ignored rows get a zero gradient
        nll = torch.empty(T, dtype=torch.float32, device=hidden.device)
        dh_parts = []  # per chunk (one chunk: the gradient itself, no copy)
        dw = None  # the first chunk writes it whole, the others accumulate
        if want_w:
            dw = torch.zeros_like(weight) if T == 0 else empty_unfilled(weight.shape, weight.dtype, weight.device)
        step = _head_rows(V, hidden.device)
        wt = weight.t()
        buf = None  # the BLAS's logits chunk, reused (oneDNN hands back one of its own)
        if not onednn_gemm.applies(hidden, weight, None):
            buf = empty_unfilled((min(step, T), V), torch.float32, hidden.device)
        for a in range(0, T, step):
            h = hidden[a:a + step]
            p = _mm(h, wt, out=None if buf is None else buf[:h.shape[0]])  # the logits, turned in place into
            # their gradient below, a cache-sized block of rows at a time (the GEMMs want the whole
            # chunk): 2048 x 32000 on 2 AMD cores, 44 ms in 64-row blocks against 92 ms whole
            blk = max(1, _row_chunk(V) // 2)
            for b in range(0, h.shape[0], blk):
                rows = slice(a + b, a + min(b + blk, h.shape[0]))
                nll[rows] = _loss_and_gradient_(p[b:b + blk], safe[rows], scale[rows], want_h or want_w)
            if want_h or want_w:
                if want_h:
                    dh_parts.append(_mm(p, weight))
                if want_w and onednn_gemm.applies(h.t(), p.t(), None):
                    # (hᵀ p)ᵀ: oneDNN reads p transposed as its weight, where pᵀ as its input was first
                    # copied whole, (V x rows) per chunk: 205 against 291 ms per 1048-row chunk of a
                    # 32000 x 512 head on 2 AMD cores (MKL's pᵀ h: 188)
                    part = onednn_gemm.mm(h.t(), p).t()
                    dw.copy_(part) if a == 0 else dw.add_(part)
                elif want_w and a == 0:
                    torch.mm(p.t(), h, out=dw)
                elif want_w:
                    dw.addmm_(p.t(), h)
        dh = None
        if want_h:
            dh = dh_parts[0] if len(dh_parts) == 1 else torch.cat(dh_parts) if dh_parts else torch.zeros_like(hidden)
        ctx.save_for_backward(dh, dw, grad_hint)
        return (nll * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dh, dw, hint = ctx.saved_tensors
        if not torch.equal(grad.float(), hint.float()):
            ratio = grad.float() / hint.float()
            dh = dh * ratio if dh is not None else None
            dw = dw * ratio if dw is not None else None
        return dh, dw, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             grad_hint: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``cross_entropy_sum(hidden @ weight.T, labels)`` for (T, H) ``hidden`` and a (V, H) head
    ``weight``, never holding the (T, V) logits or their gradient: both gradients are computed in
    the forward, chunk by chunk. ``grad_hint``: the gradient the loss will get in backward (e.g.
    1 / tokens); any other gradient is still exact, at one more pass over the weight gradient."""
    hint = torch.as_tensor(grad_hint, dtype=torch.float32, device=hidden.device)
    if hint.device.type == "cpu" and float(hint) == 0.0:  # nothing could be rescaled from a zero gradient
        raise ValueError("linear_cross_entropy_sum: grad_hint must be non-zero")
    return _LinearCrossEntropySum.apply(hidden, weight, labels, hint, torch.is_grad_enabled())
