"""One CPU rank under a 16-bit policy casts its parameters itself (``distributed/one_rank_cast.py``)
instead of wrapping them in FSDP: the same numbers as FSDP at one rank, bitwise, without FSDP's copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fixtures import CKPT, DETERMINISTIC
from helpers import records, run_small
from hyperpar.distributed.one_rank_cast import OneRankCast, one_rank_cast_of

BF16 = ["train.mixed_precision.param_dtype=bfloat16"]
FSDP = ["train.mixed_precision.one_rank_cast=false"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h * gain))


class _Net(nn.Module):
    """Two blocks and a head sharing the embedding (a parameter used twice). The blocks get an fp32
    input made in the forward (as rotary cos/sin are), which each unit must cast as FSDP's
    ``cast_forward_inputs`` does: uncast, ``h * gain`` would run in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 8))

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        gain = scale * self.gain  # fp32: the buffer is
        for block in self.blocks:
            h = block(h, gain)
        return h @ self.embed.weight.T


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _grads_by_hand(net: _Net, batches) -> dict[str, torch.Tensor]:
    """What FSDP computes at one rank: 16-bit leaf copies of the parameters and of every unit's
    floating-point inputs, every micro-batch's 16-bit gradient added to the fp32 sum."""
    bf = torch.bfloat16
    w = {n: p.detach().to(bf).requires_grad_() for n, p in net.named_parameters()}
    total: dict[str, torch.Tensor] = {}
    for ids, scale in batches:
        h = torch.nn.functional.embedding(ids, w["embed.weight"])
        gain = (scale.to(bf) * net.gain).to(bf)
        for i in range(2):
            h = torch.tanh(torch.nn.functional.linear(h * gain, w[f"blocks.{i}.lin.weight"], w[f"blocks.{i}.lin.bias"]))
        (h @ w["embed.weight"].T).float().square().mean().backward()
        for n, c in w.items():
            total[n] = c.grad.float() if n not in total else total[n].add_(c.grad)
            c.grad = None
    return total


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (3, 5), generator=g), torch.rand((), generator=g) + 0.5) for _ in range(2)]


def test_casts_accumulate_fp32_gradients_like_fsdp_and_leave_fp32_parameters():
    net = _net()
    masters = {n: p.detach().clone() for n, p in net.named_parameters()}
    want = _grads_by_hand(_net(), _batches())
    OneRankCast(net, list(net.blocks), torch.bfloat16)
    for step in range(2):  # the second step reuses the cast buffers
        net.zero_grad(set_to_none=True)
        for ids, scale in _batches():
            out = net(ids, scale)
            assert out.dtype == torch.bfloat16 and net.embed.weight.dtype == torch.bfloat16  # held to the backward
            out.float().square().mean().backward()
            assert net.embed.weight.dtype == torch.float32  # the backward's end restored them
        for n, p in net.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32
            assert torch.equal(p.detach(), masters[n]), n
            assert torch.equal(p.grad, want[n]), n
        # no hook piles up on the parameters (only forward outputs get the end-of-backward hook)
        assert not net.embed.weight._backward_hooks


def test_a_forward_without_backward_puts_the_fp32_parameters_back():
    net = _net()
    OneRankCast(net, list(net.blocks), torch.bfloat16)
    ids, scale = _batches()[0]
    with torch.no_grad():
        assert net(ids, scale).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in net.parameters())
    with pytest.raises(RuntimeError):
        net(ids.float(), scale)  # the embedding refuses float ids: the forward raises
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert not one_rank_cast_of(net).active


@pytest.mark.parametrize("case", [
    ["model=qwen3_5", "train.global_batch_size=4", "train.micro_batch_size=2"],  # 2 micro-batches
    ["model=qwen3_5", "train.global_batch_size=4", "train.micro_batch_size=2", "train.activation_checkpoint=full"],
    ["model=qwen3_5_moe", "train.global_batch_size=1", "train.micro_batch_size=1"],
    ["model=qwen3_vl_moe", "train.seq_len=64", "train.global_batch_size=1", "train.micro_batch_size=1"],  # images
], ids=["dense_accumulate", "dense_ac_full", "moe", "vl"])
def test_one_step_equals_fsdp_at_one_rank_bitwise(case):
    from layout_grads import layout_grads, max_rel_grad_diff

    base = ["parallel=single", "train.seq_len=32", *BF16, *case]
    fsdp, cast = layout_grads([*base, *FSDP], 1), layout_grads(base, 1)
    assert set(cast["grads"]) == set(fsdp["grads"])
    assert all(g.dtype == torch.float32 for g in cast["grads"].values())
    assert cast["loss"] == fsdp["loss"] and cast["grad_norm"] == fsdp["grad_norm"]
    assert max_rel_grad_diff(fsdp, cast)[0] == 0.0


def test_training_resume_and_checkpoint_equal_fsdp_at_one_rank(tmp_path):
    """Six bf16 steps with casts, stopped and resumed at 5, equal FSDP's uninterrupted run in every
    logged figure; the checkpoint holds fp32 weights."""
    from hyperpar.checkpoint.state import read_metadata

    fsdp, cast = tmp_path / "fsdp", tmp_path / "cast"
    run_small(fsdp, [*BF16, *FSDP], steps=6)
    run_small(cast, [*BF16, *CKPT, "train.stop_after_steps=5"], steps=6)
    run_small(cast, [*BF16, *CKPT], steps=6)

    def figures(run):
        return {s: {k: r[k] for k in DETERMINISTIC} for s, r in records(run).items()}

    assert figures(cast) == figures(fsdp)
    meta = read_metadata(cast / "checkpoints" / "step_5")
    weights = {k: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert weights and all(str(v.properties.dtype) == "torch.float32" for v in weights.values())
