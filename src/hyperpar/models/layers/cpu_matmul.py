"""16-bit matmuls on CPUs that have no 16-bit GEMM: fp32 GEMMs on the 16-bit values.

On x86 CPUs without AVX-512 (oneDNN reports no bf16/fp16 support there, e.g. AVX2-only AMD EPYC),
torch's CPU bf16 GEMM falls back to slow paths: measured on such a 2-core host, 19 GFLOP/s for
``x @ w.T`` (a linear's forward), 0.6 GFLOP/s for ``g @ w`` (its input gradient), 7x slower SDPA and
8-127x slower grouped GEMMs, against ~160 GFLOP/s for the same GEMM in fp32. There a bf16 step takes
minutes.

Intel CPUs without AMX have a bf16 GEMM that is slower than their fp32 one: AVX-512 bf16's dot
product instruction does as many multiply-adds a cycle as the fp32 FMAs do (half the values per
instruction, one port instead of two), and oneDNN's bf16 kernels add conversions on top. Measured on
2 cores of an Intel Xeon with AVX-512 bf16 and fp16 but no AMX, 2 threads, dense_small's linear
shapes: 177-184 GFLOP/s bf16 against 277-357 fp32 (bf16 SDPA 21 ms against 14 fp32); a bf16 training
step took 3.9 s native against 2.5 s with fp32 GEMMs, where fp32 training itself took 2.3-2.5 s.
On an AMD CPU with AVX-512 bf16 (Zen 4) the same instruction runs at twice the fp32 rate (bf16 peak
~2x fp32), and with AMX at ~6x: there the native GEMM is the faster one.

The policy ``upcast`` (``train.mixed_precision.cpu_matmul``: auto | native | fp32) runs such a
matmul as an fp32 GEMM on the 16-bit values and rounds the result back to 16 bits. That is what a
16-bit GEMM with fp32 accumulation computes (the product of two bf16 values is exact in fp32), up
to the order of the sums: parameters, activations, saved tensors and gradients stay 16-bit. "auto"
does it on a CPU that lacks the 16-bit GEMM (as oneDNN reports it) and, for bf16, on an x86 CPU
whose bf16 GEMM is the slower (Intel without AMX, :func:`slow_bf16_gemm`); "native" never; "fp32"
always (on CPU).
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hyperpar import cpu_info
from hyperpar.models.layers import onednn_gemm

POLICIES = ("auto", "native", "fp32")
_HALF = (torch.bfloat16, torch.float16)
_policy = "auto"

# Rows per fp32 chunk of a wide output (the 32000-column head): its fp32 result is never whole.
_CHUNK_ELEMS = 1 << 23  # 32 MB of fp32


def set_policy(policy: str) -> str:
    """Set the process's policy; returns the previous one."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"cpu_matmul={policy!r}: one of {', '.join(POLICIES)}")
    before, _policy = _policy, policy
    return before


@functools.cache
def _probe_half_gemm(dtype: torch.dtype) -> bool:
    probe = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    try:
        return bool(probe())
    except (AttributeError, RuntimeError):  # a build without oneDNN: assume the native path is the one to use
        return True


def _cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info.field("flags").split())  # empty off Linux: auto trusts oneDNN's report


@functools.cache
def slow_bf16_gemm() -> bool:
    """Whether this CPU's bf16 GEMM is slower than its fp32 one although oneDNN has one: an Intel x86
    CPU without AMX (its bf16 runs on AVX-512 bf16 dot products, or emulated on AVX-512, at or below
    the fp32 FMA rate; module docstring). Linux only (it reads the CPU's flags); AMD (Zen 4: bf16 at
    twice the fp32 rate) and non-x86 CPUs keep the native GEMM."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    return bool(flags) and "amx_bf16" not in flags and onednn_gemm._cpu_vendor() == "GenuineIntel"


# A constant to torch.compile: traced, the probe (an op returning a bool) broke the graph at every
# 16-bit linear of a compiled block (30 breaks per dense_small step, each a separate compiled graph).
@torch.compiler.assume_constant_result
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has a 16-bit GEMM of ``dtype`` (as oneDNN reports it) that ``auto`` uses: for
    bf16, not where it is slower than fp32 (:func:`slow_bf16_gemm`)."""
    if dtype == torch.bfloat16 and slow_bf16_gemm():
        return False
    return _probe_half_gemm(dtype)


def _upcasts(dtype: torch.dtype) -> bool:
    """Whether a CPU matmul in ``dtype`` runs as an fp32 GEMM under the policy."""
    if dtype not in _HALF or _policy == "native":
        return False
    return _policy == "fp32" or not native_half_gemm(dtype)


def upcast(t: torch.Tensor) -> bool:
    """Whether a matmul on ``t`` (16-bit, on CPU) runs as an fp32 GEMM under the policy."""
    return t.device.type == "cpu" and _upcasts(t.dtype)


def describe(dtype: torch.dtype) -> str | None:
    """What 16-bit CPU matmuls do (a clause of the launcher's CPU line), or None when they run natively."""
    if not _upcasts(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    if _policy != "auto":
        why = "cpu_matmul=fp32"
    elif _probe_half_gemm(dtype):
        why = f"this CPU's {name} GEMM is slower than its fp32 GEMM (Intel without AMX)"
    else:
        why = f"this CPU has no {name} GEMM (oneDNN)"
    return f"{why}: 16-bit matmuls run as fp32 GEMMs on the 16-bit values, rounded back (train.mixed_precision.cpu_matmul)"


def _rows(n_out: int) -> int:
    return max(256, _CHUNK_ELEMS // max(n_out, 1))


class _Fp32Linear(torch.autograd.Function):
    """``F.linear`` on 16-bit tensors through fp32 GEMMs; saves the 16-bit input and weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        w32 = w.float()
        b32 = b.float() if b is not None else None
        x2 = x.reshape(-1, x.shape[-1])
        # allocated in its final shape: a view returned from here is one FSDP warns about at a root's output
        out = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
        rows = out.view(-1, w.shape[0])
        step = _rows(w.shape[0])
        for a in range(0, x2.shape[0], step):
            rows[a:a + step] = F.linear(x2[a:a + step].float(), w32, b32)
        return out

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        w32 = w.float()
        dx = torch.empty_like(x2) if need_x else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        db = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b and ctx.has_bias else None
        step = _rows(w.shape[0])
        for a in range(0, g2.shape[0], step):
            g = g2[a:a + step].float()
            if dx is not None:
                dx[a:a + step] = g @ w32
            if dw is not None:
                dw.addmm_(g.t(), x2[a:a + step].float())
            if db is not None:
                db += g.sum(0)
        return (
            dx.view(x.shape) if dx is not None else None,
            dw.to(w.dtype) if dw is not None else None,
            db.to(w.dtype) if db is not None else None,
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, onednn: bool = True) -> torch.Tensor:
    """``F.linear``, through fp32 GEMMs where the policy says so for these 16-bit CPU tensors, and through
    oneDNN's GEMM for fp32 CPU tensors where ``launch.cpu_gemm`` says so (:mod:`.onednn_gemm`) unless
    ``onednn=False``."""
    if upcast(x) and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        if isinstance(x, DTensor) or isinstance(weight, DTensor):
            # Tensor parallel: the same casts through DTensor's own ops (autograd then keeps the fp32
            # copies of input and weight for the backward, the price of not writing sharding rules).
            return F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(x.dtype)
        return _Fp32Linear.apply(x, weight, bias)
    if onednn and onednn_gemm.applies(x, weight, bias):
        return onednn_gemm.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys, same TP plans) whose matmul follows the
    process's CPU GEMM policies (16-bit: ``cpu_matmul``; fp32: ``launch.cpu_gemm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
