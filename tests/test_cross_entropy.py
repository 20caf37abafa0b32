"""The chunked cross-entropy equals PyTorch's in value and gradient (fp32 and bf16 logits, ignored
rows, several chunks with a ragged last one), eager and compiled (``train.compile``'s kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyperpar.models.layers import compiled
from hyperpar.train import cross_entropy as ce


# the gradient formed in the forward (0.7, the real one), rescaled in the backward (1.0), or formed
# in the backward from the kept logits (None)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("hint", [0.7, 1.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_sum_equals_torch(monkeypatch, dtype, hint, compiled):
    monkeypatch.setattr(ce, "_row_chunk", lambda vocab, device=None: 7)  # 50 rows: 7 full chunks and one of 1
    if compiled:  # the compiled kernel, not the eager passes
        monkeypatch.setattr(ce, "_loss_and_gradient_", lambda *a: pytest.fail("eager passes ran"))
    torch.manual_seed(0)
    x = (torch.randn(50, 300) * 4).to(dtype).requires_grad_()
    y = torch.randint(0, 300, (50,))
    y[::6] = -100
    got = ce.cross_entropy_sum(x, y, hint, compiled=compiled)
    (got * 0.7).backward()
    g = x.grad.clone()
    x.grad = None
    ref = F.cross_entropy(x.float(), y, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    assert got.dtype == torch.float32 and g.dtype == dtype
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # fp32 rounding (|grad| <= 0.7); bf16: one rounding
    assert (g.float() - x.grad.float()).abs().max().item() <= tol
    assert g[::6].eq(0).all()  # ignored rows get no gradient


def test_all_rows_ignored_gives_zero():
    x = torch.randn(4, 10, requires_grad=True)
    loss = ce.cross_entropy_sum(x, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.eq(0).all()


@pytest.mark.parametrize("compiled", [False, True])
def test_cross_entropy_sum_without_grad_keeps_nothing_for_backward(compiled):
    """Under no_grad (evaluation) no gradient is formed; a later backward through it is impossible."""
    x = torch.randn(6, 10, requires_grad=True)
    y = torch.randint(0, 10, (6,))
    with torch.no_grad():
        loss = ce.cross_entropy_sum(x, y, compiled=compiled)
    assert not loss.requires_grad
    ref = F.cross_entropy(x.detach(), y, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()


def _fp64_reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, grad: float):
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.t(), y, ignore_index=-100, reduction="sum")
    (loss * grad).backward()
    return loss.item(), h64.grad, w64.grad


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("hint_matches", [True, False])
def test_linear_cross_entropy_sum_against_fp64(monkeypatch, hint_matches, compiled):
    """The fused head + loss: value and both gradients against fp64, over several chunks (a ragged
    last one) with ignored rows; a real upstream gradient other than the hint is applied in backward."""
    monkeypatch.setattr(ce, "_head_rows", lambda vocab, device: 7)  # 50 rows: 7 full chunks and one of 1
    monkeypatch.setattr(ce, "_row_chunk", lambda vocab, device=None: 6)  # a chunk's element-wise work in blocks of 3, 3, 1
    if compiled:  # blocks of 6 and 1, through the compiled kernel
        monkeypatch.setattr(ce, "_loss_and_gradient_", lambda *a: pytest.fail("eager passes ran"))
    torch.manual_seed(0)
    h = torch.randn(50, 24, requires_grad=True)
    w = (torch.randn(300, 24) * 0.5).requires_grad_()
    y = torch.randint(0, 300, (50,))
    y[::6] = -100
    grad = 1.0 / 43
    got = ce.linear_cross_entropy_sum(h, w, y, torch.tensor(grad if hint_matches else 0.25), compiled=compiled)
    (got * grad).backward()  # d(got · grad)/d(got) = grad: the hint, or not
    ref, gh, gw = _fp64_reference(h, w, y, grad)
    assert got.dtype == torch.float32 and h.grad.dtype == torch.float32
    assert abs(got.item() - ref) <= 1e-6 * ref
    assert (h.grad.double() - gh).abs().max().item() <= 1e-7
    assert (w.grad.double() - gw).abs().max().item() <= 1e-7
    assert h.grad[::6].eq(0).all()  # ignored rows get no gradient
    assert gw.abs().max().item() > 1e-3  # the gradients compared are not vanishing


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("upstream", [1.0 / 43, 0.25])  # the hint, or another real gradient
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_fused_head_equals_the_upcast_unfused_head(monkeypatch, dtype, upstream, compiled):
    """A 16-bit head where the CPU's 16-bit matmuls run as fp32 GEMMs (cpu_matmul): the fused kernel
    rounds the logits, their gradient and both input gradients to 16 bits where the unfused head (an
    fp32-GEMM linear giving 16-bit logits, then the chunked loss) does: bitwise the same loss and
    gradients (several chunks, a ragged last one, ignored rows). A real upstream gradient other than
    the hint is applied after the GEMMs here, before them there: both as close to fp64."""
    from hyperpar.models.layers import cpu_matmul

    monkeypatch.setattr(ce, "_head_rows", lambda vocab, device: 7)
    monkeypatch.setattr(ce, "_row_chunk", lambda vocab, device=None: 6)
    before = cpu_matmul.set_policy("fp32")
    try:
        torch.manual_seed(3)
        h = torch.randn(50, 24).to(dtype).requires_grad_()
        w = (torch.randn(300, 24) * 0.5).to(dtype).requires_grad_()
        y = torch.randint(0, 300, (50,))
        y[::6] = -100
        fused = ce.linear_cross_entropy_sum(h, w, y, 1.0 / 43, compiled=compiled)
        (fused * upstream).backward()
        gh, gw = h.grad, w.grad
        h.grad = w.grad = None
        unfused = ce.cross_entropy_sum(cpu_matmul.linear(h, w), y, 1.0 / 43, compiled=compiled)
        (unfused * upstream).backward()
    finally:
        cpu_matmul.set_policy(before)
    assert fused.dtype == torch.float32 and gh.dtype == dtype and gw.dtype == dtype
    assert torch.equal(fused, unfused)
    assert gh.abs().max().item() > 1e-3 and gw.abs().max().item() > 1e-3 and gh[::6].eq(0).all()
    if upstream == 1.0 / 43:
        assert torch.equal(gh, h.grad) and torch.equal(gw, w.grad)
        return
    _, rh, rw = _fp64_reference(h, w, y, upstream)
    for got, want, exact in ((gh, h.grad, rh), (gw, w.grad, rw)):
        err_fused = (got.double() - exact).abs().max().item()
        assert err_fused <= 1.5 * (want.double() - exact).abs().max().item() + 1e-6


def test_linear_cross_entropy_sum_equals_unfused_head_and_loss():
    """Within fp32 rounding of what the unfused path (logits, then the chunked loss) computes; the
    gradient of a frozen head weight is not formed."""
    torch.manual_seed(1)
    h = torch.randn(2, 33, 16, requires_grad=True)
    w = torch.randn(500, 16)
    y = torch.randint(0, 500, (2, 33))
    fused = ce.linear_cross_entropy_sum(h.flatten(0, 1), w, y.flatten(), 0.5)
    (fused * 0.5).backward()
    g = h.grad.clone()
    h.grad = None
    unfused = ce.cross_entropy_sum((h @ w.t()).flatten(0, 1), y.flatten())
    (unfused * 0.5).backward()
    assert abs(fused.item() - unfused.item()) <= 2e-6 * unfused.item()
    # h's gradient sums 500 O(1) vocab terms in another order: sqrt(500) * 2^-24 ~ 1.3e-6 is the rounding scale
    assert (g - h.grad).abs().max().item() <= 2e-6 and w.grad is None


@pytest.mark.parametrize("compiled", [False, True])
def test_linear_cross_entropy_sum_without_grad_forms_no_gradient(monkeypatch, compiled):
    calls = []
    monkeypatch.setattr(ce, "_mm", lambda a, b, out=None: calls.append(a.shape) or torch.mm(a, b, out=out))
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    y = torch.randint(0, 40, (10,))
    with torch.no_grad():
        loss = ce.linear_cross_entropy_sum(h, w, y, compiled=compiled)
    assert len(calls) == 1 and loss.item() > 0  # the logits only: no gradient GEMMs
    ref = F.cross_entropy(h @ w.t(), y, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    with pytest.raises(ValueError, match="non-zero"):
        ce.linear_cross_entropy_sum(h, w, torch.randint(0, 40, (10,)), 0.0)


def test_compiled_kernels_run_compiled(monkeypatch):
    """``compiled`` really takes the compiled kernels (not the eager chunks), and they give the eager
    result: a 16-bit gradient all but bitwise, the loss within fp32 rounding."""
    monkeypatch.setattr(ce, "_loss_and_gradient_", lambda *a: pytest.fail("eager passes ran"))
    torch.manual_seed(2)
    x = (torch.randn(64, 1000) * 3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 1000, (64,))
    loss = ce.cross_entropy_sum(x, y, 1.0, compiled=True)
    loss.backward()
    monkeypatch.undo()
    xe = x.detach().clone().requires_grad_()
    ref = ce.cross_entropy_sum(xe, y, 1.0)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert (x.grad == xe.grad).float().mean().item() > 0.99
    assert (x.grad.float() - xe.grad.float()).abs().max().item() <= 2 ** -8 * xe.grad.float().abs().max().item()


def test_compiled_kernels_do_not_recompile_per_row_count():
    """Micro-batches of ever new sizes (each a ragged chunk too) compile the kernel at most twice:
    static, then with the rows dynamic."""
    from torch._dynamo.utils import counters

    compiled.clear()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(3)
    for rows in (5, 6, 9, 13, 17):
        x = torch.randn(rows, 200, requires_grad=True)
        y = torch.randint(0, 200, (rows,))
        got = ce.cross_entropy_sum(x, y, 1.0, compiled=True)
        got.backward()
        ref = F.cross_entropy(x.detach(), y, reduction="sum")
        assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()
    assert counters["stats"]["unique_graphs"] <= 2
