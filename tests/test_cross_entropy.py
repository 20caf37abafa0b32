"""The chunked cross-entropy equals PyTorch's in value and gradient (fp32 and bf16 logits, ignored
rows, several chunks with a ragged last one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyperpar.train import cross_entropy as ce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_sum_equals_torch(monkeypatch, dtype):
    monkeypatch.setattr(ce, "_row_chunk", lambda vocab: 7)  # 50 rows: 7 full chunks and one of 1
    torch.manual_seed(0)
    x = (torch.randn(50, 300) * 4).to(dtype).requires_grad_()
    y = torch.randint(0, 300, (50,))
    y[::6] = -100
    got = ce.cross_entropy_sum(x, y)
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
