"""Selective activation checkpointing keeps the output of every GEMM and attention kernel, whichever
op runs it: torch's ``mm``/``bmm``/``baddbmm``, our oneDNN op (``launch.cpu_gemm``), the experts'
grouped GEMM or loop op, SDPA's kernels, the varlen kernel of packed documents. An op missing from
the save policy is recomputed in the backward, which makes ``selective`` cost what ``full`` costs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyperpar.distributed.activation_checkpoint import wrap_block
from hyperpar.models.layers import onednn_gemm
from hyperpar.models.layers.attention import attention_core
from hyperpar.models.layers.documents import Documents
from hyperpar.models.layers.cpu_matmul import Linear
from hyperpar.models.layers.gated_deltanet import chunk_gated_delta_rule
from hyperpar.models.layers.moe import experts_forward, grouped_mm_supported

# the forward ops alone: a backward kernel has its own name, so a recomputed forward adds one call
ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
             "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
             "torch_attn._varlen_attn")
GEMMS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "hyperpar.onednn_gemm", "hyperpar.expert_loop_mm",
         "aten._grouped_mm")


class _CountCalls(TorchDispatchMode):
    def __init__(self, names: tuple[str, ...] = GEMMS) -> None:
        super().__init__()
        self.names = names
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.names:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Linear(32, 64, bias=False)
        self.down = Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class _Experts(nn.Module):
    def __init__(self, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.w_gate = nn.Parameter(torch.randn(4, 16, 32) / 6)
        self.w_up = nn.Parameter(torch.randn(4, 16, 32) / 6)
        self.w_down = nn.Parameter(torch.randn(4, 32, 16) / 4)
        self.register_buffer("counts", torch.tensor([5, 0, 7, 4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.counts, self.w_gate, self.w_up, self.w_down, impl=self.impl)


class _DeltaRule(nn.Module):
    """The chunked delta rule on projections of x: its chunk scan's state updates are ``baddbmm``s."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(3, 16, 16) / 4)
        self.gates = nn.Parameter(torch.randn(2, 16, 2) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S = x.shape[:2]
        q, k, v = (torch.matmul(x, w).view(B, S, 2, 8) for w in self.proj)
        g, beta = torch.matmul(x, self.gates[0]), torch.matmul(x, self.gates[1])
        return chunk_gated_delta_rule(q, k, v, -F.softplus(g), beta.sigmoid(), chunk_size=8)


def _calls_and_grads(block: nn.Module, mode: str, x: torch.Tensor, names: tuple[str, ...] = GEMMS):
    block.zero_grad(set_to_none=True)
    model = block if mode == "none" else wrap_block(block, mode)
    x = x.detach().clone().requires_grad_()
    with _CountCalls(names) as count:
        model(x).square().sum().backward()
    return count.calls, [x.grad, *(p.grad for p in block.parameters())]


def _check(block: nn.Module, x: torch.Tensor, names: tuple[str, ...] = GEMMS) -> None:
    none, ref = _calls_and_grads(block, "none", x, names)
    selective, grads = _calls_and_grads(block, "selective", x, names)
    full, _ = _calls_and_grads(block, "full", x, names)
    assert full > none > 0  # the count sees the recomputed forward
    assert selective == none, f"selective recomputed {selective - none} kernel call(s)"
    for a, b in zip(grads, ref):  # a GPU's attention backward may sum in a different order run to run
        torch.testing.assert_close(a, b, **(dict(rtol=1e-2, atol=1e-2) if a.is_cuda else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("policy", ["blas", "onednn"])
def test_selective_recomputes_no_linear_gemm(monkeypatch, policy):
    if policy == "onednn" and not onednn_gemm.available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(onednn_gemm, "_MIN_MACS", 0)  # the small GEMMs here take the oneDNN path too
    before = onednn_gemm.set_policy(policy)
    try:
        torch.manual_seed(0)
        _check(_Mlp(), torch.randn(2, 24, 32))
    finally:
        onednn_gemm.set_policy(before)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_selective_recomputes_no_expert_gemm(impl):
    torch.manual_seed(0)
    block = _Experts(impl)
    x = torch.randn(16, 32)
    if impl == "grouped" and not grouped_mm_supported(x, block.w_gate, block.w_down):
        pytest.skip("no torch._grouped_mm for fp32 on this device")
    _check(block, x)


def test_selective_recomputes_no_delta_rule_gemm():
    torch.manual_seed(0)
    _check(_DeltaRule(), torch.randn(2, 40, 16))


class _Attention(nn.Module):
    """Causal GQA attention on projections of x, packed into two documents a row when ``packed``."""

    def __init__(self, packed: bool, impl: str) -> None:
        super().__init__()
        self.packed, self.impl = packed, impl
        self.proj = nn.Parameter(torch.randn(3, 16, 32) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S = x.shape[:2]
        w = self.proj.to(x.dtype)
        q = (x @ w[0]).view(B, S, 4, 8)
        k, v = ((x @ w[i])[..., :16].reshape(B, S, 2, 8) for i in (1, 2))
        doc = None
        if self.packed:
            pos = torch.cat([torch.arange(S // 2 + 3), torch.arange(S - S // 2 - 3)]).expand(B, S).to(x.device)
            doc = Documents.from_positions(pos)
        return attention_core(q, k, v, scale=8 ** -0.5, doc=doc, doc_impl=self.impl).float()


@pytest.mark.parametrize("device,dtype,packed,impl", [
    ("cpu", torch.float32, False, "auto"),
    ("cpu", torch.float32, True, "split"),
    ("cpu", torch.float32, True, "mask"),
    pytest.param("cuda", torch.bfloat16, False, "auto",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    pytest.param("cuda", torch.bfloat16, True, "varlen",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_selective_recomputes_no_attention_kernel(device, dtype, packed, impl):
    torch.manual_seed(0)
    _check(_Attention(packed, impl).to(device), torch.randn(2, 24, 16, device=device, dtype=dtype), ATTENTION)
