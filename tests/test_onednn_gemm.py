"""fp32 linears through oneDNN's GEMM (launch.cpu_gemm): same values and gradients as fp64, as close
as torch's BLAS path is; compiled and eager agree; the auto decision and bad policies."""

from __future__ import annotations

import pytest
import torch

from hyperpar.models.layers import onednn_gemm
from hyperpar.models.layers.cpu_matmul import Linear

pytestmark = pytest.mark.skipif(not onednn_gemm.available(), reason="torch built without oneDNN")


@pytest.fixture
def policy(monkeypatch):
    # the small GEMMs here take the oneDNN path too (the size floor has its own test)
    monkeypatch.setattr(onednn_gemm, "_MIN_MACS", 0)
    before = onednn_gemm.set_policy("auto")
    yield onednn_gemm.set_policy
    onednn_gemm.set_policy(before)


def _run(lin: Linear, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    lin.zero_grad(set_to_none=True)
    y = lin(x)
    y.backward(g)
    return y.detach(), x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("shape,out,bias", [((3, 50, 96), 160, True), ((70, 64), 9000, False)])
def test_linear_matches_fp64_as_closely_as_blas(policy, shape, out, bias):
    # 9000 outputs (from 64 inputs) take the (xᵀ g)ᵀ weight-gradient form, 160 (from 96) gᵀ x.
    torch.manual_seed(0)
    lin = Linear(shape[-1], out, bias=bias)
    x = torch.randn(shape)
    g = torch.randn(*shape[:-1], out)
    policy("onednn")
    assert onednn_gemm.uses_onednn()
    got = _run(lin, x, g)
    policy("blas")
    blas = _run(lin, x, g)
    lin64 = Linear(shape[-1], out, bias=bias).double()
    lin64.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})
    ref = _run(lin64, x.double(), g.double())
    for name, a, b, r in zip(("y", "dx", "dw", "db"), got, blas, ref):
        if r is None:
            assert a is None and b is None
            continue
        assert a.dtype == torch.float32 and a.shape == r.shape and a.is_contiguous(), name
        assert _rel(a, r) <= max(4 * _rel(b, r), 1e-6), (name, _rel(a, r), _rel(b, r))


def test_inference_and_partial_grads(policy):
    policy("onednn")
    torch.manual_seed(1)
    lin = Linear(32, 48)
    x = torch.randn(5, 32)
    with torch.no_grad():
        y = lin(x)
    torch.testing.assert_close(y, x @ lin.weight.t() + lin.bias, rtol=1e-5, atol=1e-5)
    lin.weight.requires_grad_(False)
    xr = x.clone().requires_grad_()
    lin(xr).sum().backward()
    torch.testing.assert_close(xr.grad, lin.weight.sum(0).expand(5, 32), rtol=1e-5, atol=1e-5)
    assert lin.weight.grad is None and lin.bias.grad is not None


def test_compiled_matches_eager(policy):
    policy("onednn")
    torch.manual_seed(2)
    lin = Linear(64, 96)

    def f(x):
        return torch.nn.functional.silu(lin(x)).square().sum()

    x = torch.randn(2, 40, 64)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(xe).backward()
    ge = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    torch.compile(f, fullgraph=True)(xc).backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, ge, rtol=1e-5, atol=1e-5)


def test_experts_loop_through_onednn(policy):
    from hyperpar.models.layers.moe import experts_forward

    torch.manual_seed(3)
    counts = torch.tensor([5, 0, 9, 2])
    x, grad = torch.randn(16, 32), torch.randn(16, 32)
    w_gate, w_up, w_down = torch.randn(4, 24, 32), torch.randn(4, 24, 32), torch.randn(4, 32, 24)

    def run(impl, dtype=torch.float32):
        ts = [t.to(dtype).clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
        y = experts_forward(ts[0], counts, *ts[1:], impl=impl)
        y.backward(grad.to(dtype))
        return [y.detach()] + [t.grad for t in ts]

    policy("onednn")
    got = run("auto")  # fp32 under oneDNN: the loop, its GEMMs through oneDNN
    ref = run("loop", torch.float64)
    policy("blas")
    blas = run("grouped")
    for a, b, r in zip(got, blas, ref):
        assert _rel(a, r) <= max(4 * _rel(b, r), 1e-6)
    assert torch.all(got[2][1] == 0) and torch.all(got[4][1] == 0)  # the empty expert: zero gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_loop_feeds_whole_row_quanta(policy, monkeypatch, dtype):
    # Routed row counts change every step; oneDNN's temporaries follow the sizes it is fed, so every
    # GEMM gets a multiple of 64 token rows or fewer than 64 (moe._ROW_QUANTUM: the heap reuses those
    # sizes); in 16 bits the weight gradient's rows are zero-padded to whole quanta instead (one
    # rounding). Same numbers up to rounding: experts of 0, < 64, 64k and 64k + r rows.
    from hyperpar.models.layers import moe

    torch.manual_seed(4)
    counts = torch.tensor([0, 37, 128, 200, 131])
    N, H, Ie = int(counts.sum()), 48, 40
    x, grad = torch.randn(N, H), torch.randn(N, H)
    ws = torch.randn(5, Ie, H) / 7, torch.randn(5, Ie, H) / 7, torch.randn(5, H, Ie) / 7
    shapes = []
    mm_into = moe._mm_into
    monkeypatch.setattr(moe, "_mm_into", lambda a, b, out: shapes.append((*a.shape, b.shape[1])) or mm_into(a, b, out))

    def run(impl, dt=dtype):
        ts = [t.to(dt).clone().requires_grad_() for t in (x, *ws)]
        y = moe.experts_forward(ts[0], counts, *ts[1:], impl=impl)
        y.backward(grad.to(dt))
        return [y.detach()] + [t.grad for t in ts]

    policy("onednn")
    got = run("auto")
    q = moe._ROW_QUANTUM
    assert shapes and all(d < q or d % q == 0 for s in shapes for d in s), shapes  # 200 rows as 192 + 8
    ref = run("loop", torch.float64)
    policy("blas")
    other = run("grouped")  # torch's grouped GEMM: whole experts
    for a, b, r in zip(got, other, ref):
        assert _rel(a, r) <= max(1.5 * _rel(b, r), 1e-6)
    assert all(torch.all(g[0] == 0) for g in got[2:])  # the empty expert: zero gradient, though its block starts unfilled


def test_other_dtypes_and_blas_keep_f_linear(policy):
    lin = Linear(16, 8).to(torch.bfloat16)
    assert not onednn_gemm.applies(torch.randn(2, 16, dtype=torch.bfloat16), lin.weight, lin.bias)
    policy("blas")
    assert not onednn_gemm.uses_onednn()
    assert not onednn_gemm.applies(torch.randn(2, 16), torch.randn(8, 16), None)
    assert onednn_gemm.describe() is None
    policy("onednn")
    assert onednn_gemm.applies(torch.randn(2, 16), torch.randn(8, 16), None)
    assert "oneDNN" in onednn_gemm.describe() and "tensor-parallel" not in onednn_gemm.describe()
    assert "tensor-parallel ones excepted" in onednn_gemm.describe(tensor_parallel=True)  # DTensor linears stay on F.linear


@pytest.mark.parametrize("vendor,capability,expect", [
    ("AuthenticAMD", "AVX512", True), ("GenuineIntel", "AVX512", False), ("AuthenticAMD", "AVX2", False), ("", "AVX512", False),
])
def test_auto_decision(policy, monkeypatch, vendor, capability, expect):
    onednn_gemm.auto_choice.cache_clear()
    monkeypatch.setattr(onednn_gemm, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    try:
        policy("auto")
        assert onednn_gemm.uses_onednn() is expect
        assert (onednn_gemm.describe() is not None) is expect
    finally:
        monkeypatch.undo()
        onednn_gemm.auto_choice.cache_clear()
        policy("auto")


def test_small_gemms_stay_on_the_blas(policy, monkeypatch):
    policy("onednn")
    monkeypatch.setattr(onednn_gemm, "_MIN_MACS", 1 << 23)
    w = torch.randn(512, 512)
    assert not onednn_gemm.applies(torch.randn(31, 512), w, None)  # 8.1M multiply-adds
    assert onednn_gemm.applies(torch.randn(2, 16, 512), w, None)  # 8.4M
    calls = []
    real = onednn_gemm._gemm
    monkeypatch.setattr(onednn_gemm, "_gemm", lambda *a: calls.append(1) or real(*a))
    Linear(512, 512)(torch.randn(31, 512)).sum().backward()
    assert not calls
    Linear(512, 512)(torch.randn(32, 512, requires_grad=True)).sum().backward()
    assert len(calls) == 3  # forward, input gradient, weight gradient


def test_bad_policy():
    with pytest.raises(ValueError, match="cpu_gemm='mkl'"):
        onednn_gemm.set_policy("mkl")


def test_fused_head_loss_through_onednn_matches_fp64(policy, monkeypatch):
    """The fused head's chunks (several, the last one short) through oneDNN: loss and both gradients
    as close to fp64 as the BLAS path's; the weight gradient is formed as (hᵀ p)ᵀ, so p is never
    copied transposed."""
    from hyperpar.train import cross_entropy as ce

    monkeypatch.setattr(ce, "_head_rows", lambda vocab, device: 40)
    torch.manual_seed(0)
    h0, w0 = torch.randn(100, 48), torch.randn(700, 48) * 0.3
    y = torch.randint(0, 700, (100,))
    y[::7] = -100

    def run(dtype):
        h, w = h0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
        if dtype == torch.float64:
            loss = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
        else:
            loss = ce.linear_cross_entropy_sum(h, w, y, 0.5)
        (loss * 0.5).backward()
        return loss.detach(), h.grad, w.grad

    policy("onednn")
    got = run(torch.float32)
    policy("blas")
    blas = run(torch.float32)
    ref = run(torch.float64)
    for name, a, b, r in zip(("loss", "dh", "dw"), got, blas, ref):
        assert _rel(a, r) <= max(4 * _rel(b, r), 1e-6), (name, _rel(a, r), _rel(b, r))


def test_transposed_copy_in_row_blocks(monkeypatch):
    monkeypatch.setattr(onednn_gemm, "_T_ROWS", 3)  # 11 output rows: blocks of 3, 3, 3, 2
    t = torch.randn(5, 11)
    got = onednn_gemm.transposed_copy(t)
    assert got.is_contiguous() and torch.equal(got, t.t())
    out = torch.randn(11, 5)
    want = out + t.t()
    onednn_gemm.transposed_copy(t, out=out, add=True)
    assert torch.equal(out, want)


def test_fused_head_loss_through_onednn_over_chunks(policy, monkeypatch):
    """The fused head + loss with oneDNN's GEMMs: several row chunks (the weight gradient's
    transposed blocks copied, then added), against fp64."""
    import torch.nn.functional as F

    from hyperpar.train import cross_entropy as ce

    policy("onednn")
    monkeypatch.setattr(ce, "_head_rows", lambda vocab, device: 16)  # 40 rows: chunks of 16, 16, 8
    monkeypatch.setattr(onednn_gemm, "_T_ROWS", 64)  # 300 vocab rows: 5 blocks, a ragged last one
    torch.manual_seed(3)
    h = torch.randn(40, 24, requires_grad=True)
    w = (torch.randn(300, 24) * 0.5).requires_grad_()
    y = torch.randint(0, 300, (40,))
    y[::5] = -100
    ce.linear_cross_entropy_sum(h, w, y, 1.0).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w64.t(), y, ignore_index=-100, reduction="sum").backward()
    assert _rel(w.grad, w64.grad) <= 1e-6 and _rel(h.grad, h64.grad) <= 1e-6
