"""GatedDeltaNet: chunked gated delta rule vs the per-token recurrence, conv, and the HF layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import conv1d_float64

from hyperpar.models.layers import (
    GatedDeltaNet,
    causal_depthwise_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

torch.set_num_threads(1)


def inputs(S: int, B: int = 2, nk: int = 2, nv: int = 4, dk: int = 16, dv: int = 32, seed: int = 0, decay: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, nk, dk, generator=g)
    k = torch.randn(B, S, nk, dk, generator=g)
    v = torch.randn(B, S, nv, dv, generator=g)
    gate = -torch.rand(B, S, nv, generator=g) * decay  # log decay ≤ 0
    beta = torch.rand(B, S, nv, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("S", [1, 5, 64, 70, 130])
def test_chunked_matches_recurrence(S: int) -> None:
    x = inputs(S)
    ref = recurrent_gated_delta_rule(*x)
    for chunk in (64, 32, 16):
        out = chunk_gated_delta_rule(*x, chunk_size=chunk)
        assert out.shape == ref.shape == (2, S, 4, 32)
        assert (out - ref).abs().max().item() <= 1e-5, chunk


def test_open_chunk_size_is_picked_per_device() -> None:
    """A rule built without a chunk size runs 32-token chunks on CPU (bitwise the explicit 32, not 64)
    and would run 64 on an accelerator."""
    from hyperpar.models.layers.gated_deltanet import GatedDeltaRule, default_chunk_size

    assert default_chunk_size(torch.device("cpu")) == 32
    assert default_chunk_size(torch.device("cuda", 0)) == default_chunk_size(torch.device("meta")) == 64
    q, k, v, gate, beta = inputs(100, seed=4)
    convs = [torch.randn(t.shape[-2] * t.shape[-1], 4) * 0.3 for t in (q, k, v)]
    auto = GatedDeltaRule()(q, k, v, gate, beta, *convs)
    assert "chunk_size=auto" in repr(GatedDeltaRule())
    assert torch.equal(auto, GatedDeltaRule(32)(q, k, v, gate, beta, *convs))
    assert not torch.equal(auto, GatedDeltaRule(64)(q, k, v, gate, beta, *convs))


def test_equal_heads_and_strong_decay() -> None:
    x = inputs(100, nk=3, nv=3, dk=8, dv=8, seed=1, decay=60.0)  # exp(γ) underflows inside a chunk
    out = chunk_gated_delta_rule(*x)
    assert torch.isfinite(out).all()
    assert (out - recurrent_gated_delta_rule(*x)).abs().max().item() <= 1e-5


def test_gradients_match_recurrence() -> None:
    x = [t.double().requires_grad_() for t in inputs(70, B=1, dk=8, dv=8, seed=2)]
    w = torch.randn(1, 70, 4, 8, dtype=torch.float64)
    # double inputs still run the rule in fp32; compare float grads
    (chunk_gated_delta_rule(*x) * w).sum().backward()
    got = [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    (recurrent_gated_delta_rule(*x) * w).sum().backward()
    for a, b in zip(got, (t.grad for t in x)):
        assert (a - b).abs().max().item() <= 1e-5


def test_bf16_inputs_computed_in_fp32() -> None:
    x = inputs(70)
    ref = chunk_gated_delta_rule(*x)
    q, k, v, g, beta = x
    out = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() <= 0.05


@pytest.mark.parametrize("S", [1, 2, 3, 4, 9])
def test_causal_conv_matches_conv1d(S: int) -> None:
    C, K = 6, 4
    x = torch.randn(2, S, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 1, K, dtype=torch.float64, requires_grad=True)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w, padding=K - 1, groups=C)[:, :, :S]).transpose(1, 2)
    assert (causal_depthwise_conv1d(x, w) - ref).abs().max().item() <= 1e-12
    assert torch.autograd.gradcheck(lambda a, b: causal_depthwise_conv1d(a, b), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: causal_depthwise_conv1d(a, b, silu=False), (x, w))


@pytest.mark.parametrize("S", [3, 37])
def test_compiled_16bit_conv_sums_taps_in_fp32(S: int) -> None:
    """train.compile's bf16 conv (one compiled kernel each way): output and both gradients those of
    fp32 arithmetic on the same bf16 values, rounded (a tap shifted the wrong way is off by O(1))."""
    from hyperpar.models.layers import compiled

    torch.manual_seed(0)
    C, K = 24, 4
    x = torch.randn(2, S, C).bfloat16().requires_grad_()
    w = (torch.randn(C, 1, K) * 0.5).bfloat16().requires_grad_()
    go = torch.randn(2, S, C).bfloat16()
    compiled.clear()
    out = causal_depthwise_conv1d(x, w, compiled=True)
    out.backward(go)
    assert compiled.compiled_names() == {"_conv_forward", "_conv_backward"} and out.dtype == torch.bfloat16
    ref, dx64, dw64 = conv1d_float64(x, w, go)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * 2**-8 * scale  # two bf16 roundings (pre, silu)
    for got, want in ((x.grad, dx64), (w.grad, dw64)):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max().item() <= 2**-6 * want.abs().max().item()


@pytest.mark.parametrize("S", [1, 3, 37])
def test_compiled_fp32_conv_matches_float64(S: int) -> None:
    """train.compile's fp32 conv (the tap-major weight, one padded range per tap): output and both
    gradients those of float64 arithmetic to fp32 rounding (a tap or weight row swapped is off by O(1))."""
    from hyperpar.models.layers import compiled

    torch.manual_seed(1)
    C, K = 40, 4
    x = torch.randn(2, S, C, requires_grad=True)
    w = torch.randn(C, 1, K, requires_grad=True)
    go = torch.randn(2, S, C)
    compiled.clear()
    out = causal_depthwise_conv1d(x, w, compiled=True)
    out.backward(go)
    assert compiled.compiled_names() == {"_conv_forward", "_conv_backward"}
    ref, dx64, dw64 = conv1d_float64(x, w, go)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    for got, want in ((x.grad, dx64), (w.grad, dw64)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_layer_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=1, rms_norm_eps=1e-6,
        layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(cfg, 0).float()
    with torch.no_grad():
        hf.norm.weight.normal_(1.0, 0.2)
    ours = GatedDeltaNet(64, 2, 4, 16, 32, 4, eps=1e-6)
    sizes = [2 * 16, 2 * 16, 4 * 32]  # the fused rows [Q; K; V]

    def split(state: dict) -> dict:
        state = dict(state)
        for fused, parts in (("in_proj_qkv", ("in_proj_q", "in_proj_k", "in_proj_v")), ("conv1d", ("conv1d_q", "conv1d_k", "conv1d_v"))):
            for part, t in zip(parts, state.pop(f"{fused}.weight").split(sizes)):
                state[f"{part}.weight"] = t
        return state

    ours.load_state_dict(split(hf.state_dict()))
    x = torch.randn(2, 70, 64, requires_grad=True)
    ref = hf(x)
    out = ours(x)
    assert (out - ref).abs().max().item() <= 1e-5
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    ref_grads = split({n: p.grad.clone() for n, p in hf.named_parameters()})
    gx = x.grad.clone()
    x.grad = None
    (out * w).sum().backward()
    assert (x.grad - gx).abs().max().item() <= 1e-5
    for n, p in ours.named_parameters():
        assert (p.grad - ref_grads[n]).abs().max().item() <= 1e-5 * max(1.0, ref_grads[n].abs().max().item()), n


@pytest.mark.full  # two compilations, ~70 s on 2 cores; tests/test_compile.py compiles the rule in CI
def test_compiled_rule_matches_eager() -> None:
    """train.compile runs the chunked rule as its own compiled graph: same output and gradients as
    eager within fp32 rounding, with and without packed documents (a tail chunk that is padded)."""
    from hyperpar.models.layers.gated_deltanet import compiled_chunk_gated_delta_rule

    seg = torch.tensor([[0] * 20 + [1] * 30 + [2] * 20, [0] * 70])
    w = torch.randn(2, 70, 4, 32, generator=torch.Generator().manual_seed(3))
    for segment_ids in (None, seg):
        results = []
        for rule in (chunk_gated_delta_rule, compiled_chunk_gated_delta_rule()):
            x = [t.requires_grad_() for t in inputs(70, seed=4)]
            out = rule(*x, 32, segment_ids=segment_ids)
            (out * w).sum().backward()
            results.append([out.detach(), *(t.grad for t in x)])
        for eager, compiled in zip(*results):
            assert (eager - compiled).abs().max().item() <= 1e-5
