"""MoE building blocks: router, grouped experts (grouped GEMM vs per-expert loop), dispatch/combine,
router statistics and the load-balancing loss (MODELS.md 6)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hyperpar.errors import ConfigError
from hyperpar.models.layers import init_param_by_module
from hyperpar.models.layers import onednn_gemm
from hyperpar.models.layers.moe import (
    GroupedExperts,
    RouterStats,
    SparseMoeBlock,
    TopKRouter,
    experts_forward,
    grouped_mm_supported,
    load_balancing_loss,
    record_router_stats,
    router_stats,
)

torch.set_num_threads(1)

E, H, IE = 8, 64, 48


def sorted_rows(counts: list[int], dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, H, generator=g).to(dtype)
    w_gu = (torch.randn(E, 2 * IE, H, generator=g) * 0.1).to(dtype)
    w_d = (torch.randn(E, H, IE, generator=g) * 0.1).to(dtype)
    return x, torch.tensor(counts), w_gu, w_d


def naive_experts(x, counts, w_gu, w_d):
    """The definition, one expert at a time with F.linear (MODELS.md 6.1 step 2)."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        gate, up = F.linear(xe, w_gu[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, w_d[e]))
        start += n
    return torch.cat(out)


def fwd_bwd(impl, x, counts, w_gu, w_d, grad):
    x, w_gu, w_d = (t.detach().clone().requires_grad_() for t in (x, w_gu, w_d))
    y = experts_forward(x, counts, *w_gu.chunk(2, dim=1), w_d, impl=impl)
    y.backward(grad)
    return y.detach(), x.grad, w_gu.grad, w_d.grad


ROUTINGS = {
    "balanced": [5, 6, 4, 7, 5, 6, 3, 4],
    "empty_experts": [0, 9, 0, 0, 12, 0, 3, 0],
    "skewed": [37, 1, 0, 0, 0, 0, 0, 2],
    "all_on_last": [0, 0, 0, 0, 0, 0, 0, 20],
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop_and_definition(routing: str, dtype: torch.dtype, monkeypatch) -> None:
    # both kernels on torch's own GEMM (the loop's fp32 GEMMs through oneDNN: tests/test_onednn_gemm.py)
    monkeypatch.setattr(onednn_gemm, "_active", False)
    x, counts, w_gu, w_d = sorted_rows(ROUTINGS[routing], dtype)
    assert grouped_mm_supported(x, w_gu, w_d)
    grad = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(9)).to(dtype)
    grouped = fwd_bwd("grouped", x, counts, w_gu, w_d, grad)
    loop = fwd_bwd("loop", x, counts, w_gu, w_d, grad)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    for a, b, what in zip(grouped, loop, ("y", "dx", "dw_gate_up", "dw_down")):
        assert (a.float() - b.float()).abs().max().item() <= tol, what
    # empty experts get exactly zero weight gradient
    for e, n in enumerate(ROUTINGS[routing]):
        if n == 0:
            assert torch.all(grouped[2][e] == 0) and torch.all(grouped[3][e] == 0)
    if dtype == torch.float32:
        ref = naive_experts(x, counts, w_gu, w_d)
        assert (grouped[0] - ref).abs().max().item() <= 1e-6


def test_unaligned_sizes_fall_back_to_loop() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g)  # 6 fp32 = 24 bytes: not 16-byte aligned
    w_gu, w_d = torch.randn(3, 10, 6, generator=g), torch.randn(3, 6, 5, generator=g)
    counts = torch.tensor([4, 0, 6])
    assert not grouped_mm_supported(x, w_gu, w_d)
    y = experts_forward(x, counts, *w_gu.chunk(2, dim=1), w_d)  # auto → loop
    ref = naive_experts(x, counts, w_gu, w_d)
    # |y| reaches ~12 here: a few fp32 ulps of the largest value
    assert (y - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
    # asked for by name (model.experts_impl=grouped), the grouped kernel is refused in one sentence
    with pytest.raises(ConfigError, match=r"experts_impl=grouped: torch._grouped_mm cannot run these experts here") as e:
        experts_forward(x, counts, *w_gu.chunk(2, dim=1), w_d, impl="grouped")
    assert "model.experts_impl=auto or loop" in e.value.hint


def test_router_renormalises_or_not() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, H)
    r = TopKRouter(H, E, 2)
    torch.nn.init.normal_(r.weight, std=0.3)
    out = r(x)
    probs = torch.softmax(F.linear(x, r.weight).float(), -1)
    top, idx = probs.topk(2, -1)
    assert torch.equal(out.indices, idx)
    assert torch.allclose(out.weights, top / top.sum(-1, keepdim=True))
    assert torch.allclose(out.weights.sum(-1), torch.ones(16))
    with pytest.raises(ValueError):
        TopKRouter(H, E, 9)


def split_experts(state: dict) -> dict:
    """transformers' packed gate_up_proj (E, 2·Ie, H) as our gate_proj / up_proj halves."""
    state = dict(state)
    for key in [k for k in state if k.endswith("experts.gate_up_proj")]:
        gate, up = state.pop(key).chunk(2, dim=1)
        base = key.removesuffix("gate_up_proj")
        state[base + "gate_proj"], state[base + "up_proj"] = gate, up
    return state


def hf_block(shared: bool, seed: int = 0):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=IE,
                               shared_expert_intermediate_size=32)
    torch.manual_seed(seed)
    block = Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_block_matches_transformers(impl: str) -> None:
    hf = hf_block(shared=True)
    ours = SparseMoeBlock(H, E, 2, IE, 32, experts_impl=impl)
    ours.load_state_dict(split_experts(hf.state_dict()))
    x = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, got = hf(xa), ours(xb)
    assert got.shape == x.shape
    assert (got - ref).abs().max().item() <= 1e-6
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got.backward(grad)
    assert (xa.grad - xb.grad).abs().max().item() <= 1e-5
    hf_grads = split_experts({n: p.grad for n, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        scale = hf_grads[name].abs().max().item()
        assert (p.grad - hf_grads[name]).abs().max().item() <= 1e-6 * max(1.0, scale), name


def test_block_without_shared_expert_and_skewed_router() -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(H, E, 2, IE)
    assert block.shared_expert is None and block.shared_expert_gate is None
    assert {n for n, _ in block.named_parameters()} == {"gate.weight", "experts.gate_proj", "experts.up_proj", "experts.down_proj"}
    for n, p in block.named_parameters():
        init_param_by_module(block, n, p.data, torch.Generator().manual_seed(0))
    # a constant feature the router reads: every token prefers experts 3 and 5, six get nothing
    x = torch.randn(40, H)
    x[:, 0] = 1.0
    with torch.no_grad():
        block.gate.weight[:, 0] = torch.tensor([0.0, 0, 0, 5, 0, 4, 0, 0])
    xg = x.clone().requires_grad_()
    with record_router_stats() as stats:
        y = block(xg)
    assert len(stats) == 1
    assert stats[0].counts.tolist() == [0, 0, 0, 40, 0, 40, 0, 0]
    ref = SparseMoeBlock(H, E, 2, IE, experts_impl="loop")
    ref.load_state_dict(block.state_dict())
    assert (ref(x) - y).abs().max().item() <= 1e-6
    y.square().sum().backward()
    assert torch.all(block.experts.gate_proj.grad[[0, 1, 2, 4, 6, 7]] == 0)
    assert block.experts.up_proj.grad[3].abs().sum() > 0


def hf_aux(logits: list[torch.Tensor], k: int, mask: torch.Tensor | None):
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(logits), logits[0].shape[-1], k, mask)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_transformers_and_pools_layers(masked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    B, S, L, k = 2, 12, 3, 2
    logits = [torch.randn(B * S, E, generator=g).requires_grad_() for _ in range(L)]
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.int64)
        mask[0, 9:] = 0  # right padding
        mask[1, 5:] = 0
    ref = hf_aux(logits, k, mask)
    stats = [router_stats(torch.softmax(lg, -1), torch.softmax(lg, -1).topk(k, -1).indices, mask) for lg in logits]
    got = load_balancing_loss(stats)
    assert abs(got.item() - ref.item()) <= 1e-6
    # pooled before the product: not the mean of per-layer losses
    per_layer = sum(load_balancing_loss(s) for s in stats) / L
    assert abs(per_layer.item() - got.item()) > 1e-6
    # gradient flows through P only
    (gr,) = torch.autograd.grad(ref, logits[0])
    (go,) = torch.autograd.grad(got, logits[0])
    assert (gr - go).abs().max().item() <= 1e-6
    pooled = RouterStats.pool(stats)
    n_tok = float(mask.sum()) if masked else float(B * S)
    assert pooled.tokens.item() == L * n_tok and pooled.counts.sum().item() == L * n_tok * k


def test_aux_loss_is_k_for_uniform_routing_and_zero_without_tokens() -> None:
    probs = torch.full((8, E), 1.0 / E)
    idx = torch.arange(16).view(8, 2) % E
    assert abs(load_balancing_loss(router_stats(probs, idx)).item() - 2.0) <= 1e-6
    none = router_stats(probs, idx, torch.zeros(8))
    assert load_balancing_loss(none).item() == 0.0


def test_recording_is_scoped_and_checkpoint_safe() -> None:
    """Stats are recorded once per forward inside the context, never by AC recomputation, and a
    checkpointed block gives the same output, aux loss and gradients as a plain one."""
    torch.manual_seed(0)
    block = SparseMoeBlock(H, E, 2, IE, 32)
    for n, p in block.named_parameters():
        init_param_by_module(block, n, p.data, torch.Generator().manual_seed(len(n)), std=0.2)
    x = torch.randn(2, 10, H)
    mask = torch.ones(2, 10)
    mask[1, 7:] = 0
    results = []
    for use_ckpt in (False, True):
        block.zero_grad()
        with record_router_stats() as stats:
            if use_ckpt:
                y = checkpoint(block, x, mask, use_reentrant=False)
            else:
                y = block(x, mask)
        assert len(stats) == 1
        aux = load_balancing_loss(stats)
        (y.square().mean() + aux).backward()
        assert len(stats) == 1  # recomputation did not record
        results.append((y.detach(), aux.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}))
    (y0, a0, g0), (y1, a1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(a0, a1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    assert g0["gate.weight"].abs().sum() > 0
    # outside any context nothing is collected, and the block still runs
    assert block(x).shape == x.shape
    with record_router_stats() as outer:
        block(x)
        with record_router_stats() as inner:
            block(x)
    assert len(outer) == 1 and len(inner) == 1


def test_experts_module_seam() -> None:
    experts = GroupedExperts(E, H, IE)
    for n, p in experts.named_parameters():
        init_param_by_module(experts, n, p.data, torch.Generator().manual_seed(0))
    assert experts.gate_proj.shape == experts.up_proj.shape == (E, IE, H) and experts.down_proj.shape == (E, H, IE)
    x, counts, _, _ = sorted_rows(ROUTINGS["empty_experts"])
    y = experts(x, counts)
    w_gu = torch.cat([experts.gate_proj, experts.up_proj], dim=1).detach()
    ref = naive_experts(x, counts, w_gu, experts.down_proj.detach())
    assert (y - ref).abs().max().item() <= 1e-6
