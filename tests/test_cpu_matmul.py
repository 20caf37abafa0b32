"""16-bit matmuls as fp32 GEMMs on the 16-bit values (train.mixed_precision.cpu_matmul): the same
results as a 16-bit GEMM with fp32 sums, held against fp64, in the kernels and in a whole model."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from hyperpar.models.layers import cpu_matmul, onednn_gemm
from hyperpar.models.layers.attention import attention_core
from hyperpar.models.layers.moe import experts_forward


@contextlib.contextmanager
def policy(name: str):
    before = cpu_matmul.set_policy(name)
    try:
        yield
    finally:
        cpu_matmul.set_policy(before)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def grads_of(fn, *leaves: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ins = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*ins)
    out.backward(upstream.to(out.dtype))
    return out.detach(), [t.grad for t in ins]


def check_against_fp64(fn, *leaves: torch.Tensor, bound: float = 1e-2) -> None:
    """fn's output and input gradients under cpu_matmul=fp32: 16-bit dtypes, within bf16 rounding of
    fp64, and no further from fp64 than torch's own 16-bit kernel (native) is, beyond rounding."""
    with torch.no_grad():
        shape = fn(*(t.double() for t in leaves)).shape
    up = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_out, ref_grads = grads_of(fn, *(t.double() for t in leaves), upstream=up)
    with policy("fp32"):
        out, grads = grads_of(fn, *leaves, upstream=up)
    with policy("native"):
        n_out, n_grads = grads_of(fn, *leaves, upstream=up)
    assert out.dtype == leaves[0].dtype
    for a, n, r in zip([out, *grads], [n_out, *n_grads], [ref_out, *ref_grads]):
        assert a.dtype == leaves[0].dtype
        err = rel_err(a, r)
        assert err <= bound, err
        assert err <= 1.5 * rel_err(n, r) + 4e-3, (err, rel_err(n, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_wide_and_chunked(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 64, generator=g).to(dtype)
    # 40000 output columns: 209 rows per fp32 chunk is raised to 256, so 600 rows take three chunks.
    w = (torch.randn(40000, 64, generator=g) * 0.1).to(dtype)
    b = torch.randn(40000, generator=g).to(dtype)
    check_against_fp64(cpu_matmul.linear, x, w, b)


def test_linear_module_keeps_nn_linear_and_fp32_untouched(monkeypatch) -> None:
    lin = cpu_matmul.Linear(8, 4, bias=False)
    assert isinstance(lin, torch.nn.Linear) and list(lin.state_dict()) == ["weight"]
    x = torch.randn(3, 8)
    monkeypatch.setattr(onednn_gemm, "_active", False)  # fp32's own GEMM choice: tests/test_onednn_gemm.py
    with policy("fp32"):  # fp32 tensors are never touched
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_attention_core_causal_gqa() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 33, 4, 16, generator=g).bfloat16()
    k = torch.randn(2, 33, 2, 16, generator=g).bfloat16()
    v = torch.randn(2, 33, 2, 16, generator=g).bfloat16()
    check_against_fp64(lambda a, b, c: attention_core(a, b, c, scale=0.25), q, k, v)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_experts(impl: str) -> None:
    g = torch.Generator().manual_seed(3)
    E, H, Ie = 4, 32, 16
    x = torch.randn(40, H, generator=g).bfloat16()
    wg, wu = (torch.randn(E, Ie, H, generator=g) * 0.2).bfloat16(), (torch.randn(E, Ie, H, generator=g) * 0.2).bfloat16()
    wd = (torch.randn(E, H, Ie, generator=g) * 0.2).bfloat16()
    counts = torch.tensor([10, 0, 18, 12])
    # fp64 (the reference) only has the loop; 16-bit inputs take ``impl``.
    fn = lambda a, b, c, d: experts_forward(a, counts, b, c, d, impl=impl if a.dtype != torch.float64 else "loop")  # noqa: E731
    check_against_fp64(fn, x, wg, wu, wd, bound=3e-2)


def test_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(2, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_matmul, "native_half_gemm", lambda dtype: False)
    with policy("auto"):
        assert cpu_matmul.upcast(t) and cpu_matmul.describe(torch.bfloat16)
        assert not cpu_matmul.upcast(t.float()) and cpu_matmul.describe(torch.float32) is None
    monkeypatch.setattr(cpu_matmul, "native_half_gemm", lambda dtype: True)
    with policy("auto"):
        assert not cpu_matmul.upcast(t) and cpu_matmul.describe(torch.bfloat16) is None
    with policy("native"):
        assert not cpu_matmul.upcast(t)
    with pytest.raises(ValueError, match="cpu_matmul"):
        cpu_matmul.set_policy("tf32")


@pytest.mark.parametrize("vendor,flags,machine,slow", [
    ("GenuineIntel", {"avx512f", "avx512_bf16"}, "x86_64", True),  # AVX-512 bf16 dot products, no AMX
    ("GenuineIntel", {"avx512f", "avx512bw"}, "x86_64", True),  # bf16 emulated on AVX-512
    ("GenuineIntel", {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "x86_64", False),
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, "x86_64", False),  # Zen 4: bf16 at twice fp32's rate
    ("GenuineIntel", set(), "x86_64", False),  # flags unknown: oneDNN's report alone
    ("", {"bf16", "sve"}, "aarch64", False),
])
def test_auto_upcasts_bf16_where_the_cpus_bf16_gemm_is_slower(monkeypatch: pytest.MonkeyPatch, vendor: str,
                                                              flags: set[str], machine: str, slow: bool) -> None:
    monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(onednn_gemm, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_matmul, "_probe_half_gemm", lambda dtype: True)  # oneDNN has both GEMMs
    cpu_matmul.slow_bf16_gemm.cache_clear()
    try:
        assert cpu_matmul.slow_bf16_gemm() is slow
        assert cpu_matmul.native_half_gemm(torch.bfloat16) is not slow
        assert cpu_matmul.native_half_gemm(torch.float16)  # fp16 follows oneDNN's report alone
        t = torch.zeros(2, dtype=torch.bfloat16)
        with policy("auto"):
            assert cpu_matmul.upcast(t) is slow
            assert not cpu_matmul.upcast(t.half())
            line = cpu_matmul.describe(torch.bfloat16)
            assert (line is not None and "slower than its fp32 GEMM" in line) if slow else line is None
        with policy("native"):
            assert not cpu_matmul.upcast(t)
    finally:
        cpu_matmul.slow_bf16_gemm.cache_clear()


def test_whole_model_bf16_as_close_to_fp32_as_native() -> None:
    """The tiny dense model in bf16, forward and backward: the fp32-GEMM path lands as close to the fp32
    model as torch's bf16 GEMM does (logits and every parameter gradient)."""
    from test_qwen3_5_parity import TINY, ids_for, make_hf, ours_from_hf

    ref = ours_from_hf(make_hf(TINY, seed=4), TINY)
    ids = ids_for(40)

    def run(model):
        model.zero_grad()
        out = model(ids)
        logits = getattr(out, "logits", out)
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    ref_logits, ref_grads = run(ref)
    errs = {}
    for name in ("fp32", "native"):
        model = ours_from_hf(make_hf(TINY, seed=4), TINY).to(torch.bfloat16)
        with policy(name):
            logits, grads = run(model)
        scale = ref_logits.abs().max()
        errs[name] = [((logits - ref_logits).abs().max() / scale).item()] + [
            ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in ref_grads.items()]
    for up, nat in zip(errs["fp32"], errs["native"]):
        assert up <= 1.5 * nat + 2e-2, (up, nat)
    assert errs["fp32"][0] < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_compiles_without_graph_breaks(dtype: torch.dtype) -> None:
    """train.compile: a block of linears is one graph. The 16-bit path asks whether the CPU has a
    16-bit GEMM; traced, that probe (an op returning a bool) broke the graph at every bf16 linear."""
    lin = cpu_matmul.Linear(16, 16).to(dtype)
    out = torch._dynamo.explain(lambda x: lin(torch.relu(lin(x))))(torch.randn(4, 16, dtype=dtype))
    assert out.graph_break_count == 0 and out.graph_count == 1, out.break_reasons


def test_upcast_linear_returns_a_tensor_of_its_own(monkeypatch) -> None:
    """Not a view: FSDP warns (and an in-place op would skip its pre-backward hook) when a root's
    output is a view; the upcast head's logits are such an output."""
    monkeypatch.setattr(cpu_matmul, "_policy", "fp32")
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    y = cpu_matmul.linear(x, w)
    assert y.shape == (2, 3, 5) and not y._is_view()
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    assert torch.equal(y, ref)
