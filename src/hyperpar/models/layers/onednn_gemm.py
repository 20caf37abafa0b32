"""fp32 linears through oneDNN's GEMM where torch's BLAS is the slower one (``launch.cpu_gemm``).

torch's CPU fp32 ``mm`` calls MKL. MKL takes its AVX-512 kernels only on Intel CPUs: on an AMD CPU
with AVX-512 (Zen 4 and later) it runs its AVX2 kernels. oneDNN, which torch also ships, picks its
kernels by instruction set. Measured on a 2-core AMD EPYC with AVX-512, 2 threads, the GEMM shapes
of dense_small's linears (forward, input gradient, weight gradient): 120-310 GFLOP/s through oneDNN
against 110-150 through MKL (docs/guide/performance.md).

Policies: ``auto`` (default) uses oneDNN on an AMD CPU with AVX-512 and the BLAS everywhere else;
``onednn`` always (CPU, fp32); ``blas`` never. The GEMMs are fp32 with fp32 sums either way; only
the order of the sums differs (~1e-6 relative on a 512-long dot product). The MoE experts' fp32
GEMMs take the per-expert loop through it too (``moe.experts_forward``). Tensor-parallel (DTensor)
weights, 16-bit tensors and non-CPU devices keep ``F.linear``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from hyperpar import cpu_info
from hyperpar.unfilled import empty_unfilled, unfilled

POLICIES = ("auto", "blas", "onednn")
_policy = "auto"
_active: bool | None = None  # the policy resolved on this CPU (read per call, also inside compiled code)
# Below ~8M multiply-adds per GEMM the custom op's and oneDNN's per-call costs outweigh the faster
# kernel (measured: a 256 x 128 -> 128 linear's step 0.40 ms with MKL, 0.53 with oneDNN; 256 x 128
# -> 384 1.04 against 0.84): such GEMMs stay on the BLAS.
_MIN_MACS = 1 << 23


def set_policy(policy: str) -> str:
    """Set the process's policy; returns the previous one."""
    global _policy, _active
    if policy not in POLICIES:
        raise ValueError(f"cpu_gemm={policy!r}: one of {', '.join(POLICIES)}")
    before, _policy = _policy, policy
    _active = _resolve(policy)
    return before


def _cpu_vendor() -> str:
    return cpu_info.field("vendor_id")  # "" off Linux: no vendor known, so auto keeps the BLAS


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")  # ATen's dispatch level


def available() -> bool:
    """Whether this torch build has oneDNN's GEMM as an op on plain tensors."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def auto_choice() -> bool:
    """What ``auto`` picks on this CPU: oneDNN on an AMD CPU with AVX-512."""
    return _cpu_vendor() == "AuthenticAMD" and _avx512() and available()


def _resolve(policy: str) -> bool:
    if policy == "blas":
        return False
    return available() if policy == "onednn" else auto_choice()


def uses_onednn() -> bool:
    """Whether fp32 CPU linears run through oneDNN under the process's policy."""
    global _active
    if _active is None:
        _active = _resolve(_policy)
    return _active


def describe(tensor_parallel: bool = False) -> str | None:
    """A clause of the launcher's CPU line when fp32 CPU linears run through oneDNN, else None.
    Tensor-parallel linears (DTensor) and small GEMMs stay on ``F.linear``: the line says so."""
    if not uses_onednn():
        return None
    why = "MKL runs its AVX2 kernels on this AMD CPU with AVX-512" if _policy == "auto" else "cpu_gemm=onednn"
    which = "fp32 linears of at least 8M multiply-adds" + (", tensor-parallel ones excepted," if tensor_parallel else "")
    return f"{why}: {which} run through oneDNN's GEMM (launch.cpu_gemm)"


# An op of our own: inductor (train.compile) keeps it as one opaque kernel call, where it would
# try (and fail) to lower torch's ``mkldnn._linear_pointwise`` as a prepacked-weight inference op.
# Defined through ``torch.library.Library``, not ``torch.library.custom_op``: the latter's Python
# dispatch wrapper cost 60-250 us a call here (more for larger outputs; 225 calls a dense_small
# step), the plain CPU kernel ~10 us. Every caller is inside an autograd.Function, so the op needs
# no autograd formula of its own.
# Its output is allocated by oneDNN's op with ``at::empty``, which train.fill_uninitialized_memory NaN-fills
# first; the GEMM writes it whole, so the fill is skipped (dense_small fp32: ~40 ms a step).
_LIB = torch.library.Library("hyperpar", "FRAGMENT")  # other modules may add ops to the namespace
_LIB.define("onednn_gemm(Tensor x, Tensor w, Tensor? b) -> Tensor")


def _gemm_kernel(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    if x.dim() == 2:
        with unfilled():
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    with unfilled():
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, b, "none", [], "")
    # a tensor of its own, not a view (as F.linear's): FSDP warns about a module returning a view
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], w.shape[0]))


_LIB.impl("onednn_gemm", _gemm_kernel, "CPU")


@torch.library.register_fake("hyperpar::onednn_gemm")
def _(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


_gemm_op = torch.ops.hyperpar.onednn_gemm.default


def _gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` for fp32 CPU tensors (x: any leading dims, any strides) through oneDNN."""
    return _gemm_op(x, w, b)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D fp32 CPU tensors through oneDNN (the experts' per-expert GEMMs)."""
    return _gemm(a, b.t())


class _OneDnnLinear(torch.autograd.Function):
    """``F.linear`` whose three GEMMs (forward, input and weight gradient) run through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return _gemm(x, w, b)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x2, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = gy.reshape(-1, gy.shape[-1])
        dx = _gemm(gy, w.t()) if need_x else None  # g @ w
        dw = None
        if need_w:
            # oneDNN's input must be contiguous, so one operand is copied transposed: gᵀ for gᵀ x, or
            # xᵀ and the (in x out) result for (xᵀ g)ᵀ. Whichever copies fewer elements: (xᵀ g)ᵀ for
            # (about) an output wider than the input (a 512 -> 1536 projection: 1.8M against 3.1M elements
            # at 2048 tokens; the 32000-row head, which also runs faster so: ~190 against ~120
            # GFLOP/s), gᵀ x otherwise. The GEMMs run as fast either way at 1536 outputs.
            # Compiled (train.compile), the transposed operand is made so here, by inductor's tiled
            # transpose (2048 x 1536: 1.5 against 3.9 ms for the copy oneDNN's op makes itself);
            # eager, oneDNN's op makes that copy (unfilled, inside it).
            xt, gt = x2.t(), g2.t()
            compiling = torch.compiler.is_compiling()
            rows, n_in, n_out = x2.shape[0], x2.shape[1], w.shape[0]
            if rows * n_out <= n_in * (rows + n_out):
                dw = _gemm(gt.contiguous() if compiling else gt, xt)
            elif compiling:
                dw = _gemm(xt.contiguous(), gt).t().contiguous()  # inductor's tiled transposes
            else:
                dw = transposed_copy(_gemm(xt, gt))
        db = g2.sum(0) if need_b and ctx.has_bias else None
        return dx, dw, db


_T_ROWS = 4096  # output rows per block of an eager transposed copy


def transposed_copy(t: torch.Tensor, out: torch.Tensor | None = None, add: bool = False) -> torch.Tensor:
    """``t.t()`` into a contiguous (or the given) tensor, or added into ``out`` (``add``), in blocks of
    output rows. One whole-tensor transposed copy of a (512, 32000) fp32 matrix took 21-26 ms on 2 AMD
    cores, blocks of 512-4096 rows 12 ms."""
    src = t.t()
    if out is None:
        out = empty_unfilled(src.shape, t.dtype, t.device)  # written whole below
    for r in range(0, src.shape[0], _T_ROWS):
        (out[r:r + _T_ROWS].add_ if add else out[r:r + _T_ROWS].copy_)(src[r:r + _T_ROWS])
    return out


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear(x, weight, bias)`` (or ``x @ weight``) takes the oneDNN path: plain fp32 CPU
    tensors, a GEMM of at least ``_MIN_MACS`` multiply-adds, policy on."""
    if isinstance(x, DTensor) or isinstance(weight, DTensor) or isinstance(bias, DTensor):
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() == 0:
        return False
    return (x.numel() // x.shape[-1]) * weight.numel() >= _MIN_MACS and uses_onednn()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN (call only where :func:`applies`)."""
    return _OneDnnLinear.apply(x, weight, bias)

