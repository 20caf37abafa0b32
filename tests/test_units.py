"""Small pure-function units: ParallelDims arithmetic, LR schedule, dummy data, the DP loader split."""

from __future__ import annotations

import pytest
import torch

from hyperpar.data.dummy import DummyTextSource
from hyperpar.data.loader import DistributedBatchLoader
from hyperpar.distributed.parallel_dims import ParallelDims
from hyperpar.errors import PlanError
from hyperpar.train.lr import lr_multiplier


def test_dp_shard_minus_one_takes_the_rest():
    p = ParallelDims(world_size=8, dp_replicate=2, dp_shard=-1)
    assert p.dp_shard == 4 and p.dp == 8 and p.fsdp_size == 4


@pytest.mark.parametrize("kw,msg", [
    (dict(world_size=4, dp_shard=3), "do not multiply"),
    (dict(world_size=6, dp_replicate=4, dp_shard=-1), "not divisible"),
    (dict(world_size=2, dp_shard=1, tp=2, vpp=2), "vpp > 1 needs pp > 1"),
    (dict(world_size=4, dp_shard=2, tp=2, ep=3), "ep 3 must divide"),
])
def test_bad_degrees(kw, msg):
    with pytest.raises(PlanError, match=msg):
        ParallelDims(**kw)


def test_model_divisibility_checks():
    p = ParallelDims(world_size=4, dp_shard=1, tp=4)
    # fewer KV heads than tp: replicated (each rank keeps the KV head its query heads read) ...
    p.check_model({"num_attention_heads": 8, "num_key_value_heads": 2}, global_batch_size=8, micro_batch_size=1)
    # ... and KV heads tp does not divide either way (rank 0's query heads read KV heads 0, 0, 0, 1) ...
    p.check_model({"num_attention_heads": 12, "num_key_value_heads": 3}, global_batch_size=8, micro_batch_size=1)
    # ... as GatedDeltaNet's key heads are (3 key heads for 12 value heads) ...
    p.check_model({"linear_num_key_heads": 3, "linear_num_value_heads": 12}, global_batch_size=8, micro_batch_size=1)
    # ... unless replication is disabled
    no_rep = ParallelDims(world_size=4, dp_shard=1, tp=4, replicate_kv_heads=False)
    for kv in (2, 3):
        with pytest.raises(PlanError, match=f"key/value heads {kv} not divisible by tp 4 and parallel.replicate_kv_heads=false"):
            no_rep.check_model({"num_attention_heads": 12, "num_key_value_heads": kv}, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(PlanError, match="linear-attention key heads 3 not divisible by tp 4 and parallel.replicate_kv_heads=false"):
        no_rep.check_model({"linear_num_key_heads": 3, "linear_num_value_heads": 12}, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(PlanError, match="linear-attention value heads 6 not divisible by tp 4"):
        p.check_model({"linear_num_key_heads": 3, "linear_num_value_heads": 6}, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(PlanError, match="attention heads 4 not divisible by tp 3"):
        ParallelDims(world_size=3, dp_shard=1, tp=3).check_model(
            {"num_attention_heads": 4, "num_key_value_heads": 1}, global_batch_size=8, micro_batch_size=1)
    # rows are padded to the sequence split: tp under SP, cp x tp with CP, nothing without SP
    assert p.seq_multiple == 4
    assert ParallelDims(world_size=4, dp_shard=1, tp=4, sequence_parallel=False).seq_multiple == 1
    assert ParallelDims(world_size=8, dp_shard=1, tp=2, cp=4).seq_multiple == 8
    assert ParallelDims(world_size=8, dp_shard=2, tp=2, cp=2, sequence_parallel=False).seq_multiple == 2
    # split unevenly (torch.chunk), no padding: vocabulary, MLP, shared and routed expert widths
    p.check_model({"vocab_size": 1001, "intermediate_size": 101, "shared_expert_intermediate_size": 33,
                   "moe_intermediate_size": 33, "num_experts": 4}, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(PlanError, match="expert intermediate size 5 leaves a rank of tp 4 an empty shard"):
        p.check_model({"moe_intermediate_size": 5}, global_batch_size=8, micro_batch_size=1)
    p = ParallelDims(world_size=2, dp_shard=2)
    with pytest.raises(PlanError, match="global_batch_size 6"):
        p.check_model({}, global_batch_size=6, micro_batch_size=2)
    p = ParallelDims(world_size=4, dp_shard=1, pp=4)
    with pytest.raises(PlanError, match="cannot fill pp"):
        p.check_model({"num_hidden_layers": 2}, global_batch_size=4, micro_batch_size=1)


def test_lr_schedule_shapes():
    kw = dict(warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, schedule="cosine", **kw) == 0.5
    assert lr_multiplier(1, schedule="cosine", **kw) == 1.0
    assert lr_multiplier(2, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(10, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(6, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_multiplier(9, schedule="constant", **kw) == 1.0


def test_dummy_samples_are_pure_functions_of_seed_and_index():
    a = DummyTextSource(seq_len=16, vocab_size=100, seed=3, num_samples=10)
    b = DummyTextSource(seq_len=16, vocab_size=100, seed=3, num_samples=10)
    assert torch.equal(a[5]["input_ids"], b[5]["input_ids"])
    assert not torch.equal(a[5]["input_ids"], a[6]["input_ids"])
    s = a[2]
    assert torch.equal(s["input_ids"][1:], s["labels"][:-1])  # labels are pre-shifted
    assert int(s["input_ids"].max()) < 100


def test_loader_gives_disjoint_slices_of_the_same_global_batch():
    src = DummyTextSource(seq_len=4, vocab_size=50, seed=0, num_samples=64)
    whole = DistributedBatchLoader(src, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    parts = [DistributedBatchLoader(src, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(2):
        full = torch.cat([mb["input_ids"] for mb in whole.next_step()])
        split = torch.cat([torch.cat([mb["input_ids"] for mb in p.next_step()]) for p in parts])
        assert torch.equal(full, split)
    state = whole.state_dict()
    again = DistributedBatchLoader(src, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    again.load_state_dict(state)
    assert torch.equal(torch.cat([mb["input_ids"] for mb in again.next_step()]),
                       torch.cat([mb["input_ids"] for mb in whole.next_step()]))


def test_rows_padded_to_the_sequence_split():
    """Pads go after the last token: ids pad_id, labels ignored, mask 0 (added when absent), positions
    counting on per row and per mRoPE channel; vision tensors untouched; a divisible row unchanged."""
    from hyperpar.data.pad import pad_to_multiple

    ids = torch.arange(10).view(2, 5)
    batch = {"input_ids": ids, "labels": ids + 1, "position_ids": torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]]),
             "pixel_values": torch.ones(3, 5)}
    out = pad_to_multiple(batch, 4, pad_id=7)
    assert out["input_ids"].tolist() == [[0, 1, 2, 3, 4, 7, 7, 7], [5, 6, 7, 8, 9, 7, 7, 7]]
    assert out["labels"][:, 5:].eq(-100).all() and out["labels"][:, :5].equal(ids + 1)
    assert out["attention_mask"].tolist() == [[1] * 5 + [0] * 3] * 2
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10]]
    assert out["pixel_values"] is batch["pixel_values"]
    mrope = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "mm_token_type_ids": torch.ones(2, 5, dtype=torch.long), "position_ids": torch.zeros(3, 2, 5, dtype=torch.long)}
    out = pad_to_multiple(mrope, 3)
    assert out["position_ids"].shape == (3, 2, 6) and out["position_ids"][:, :, 5].eq(1).all()
    assert out["mm_token_type_ids"][:, 5].eq(0).all() and out["attention_mask"][:, 5].eq(0).all()
    assert pad_to_multiple(batch, 5) is batch


def test_clip_grad_norm_scales_over_the_limit_and_leaves_grads_alone_under_it():
    from hyperpar.train.optim import clip_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7)),
              torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))]
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1e6)
    expect = torch.stack([g.float().norm() for g in before]).norm()
    torch.testing.assert_close(norm, expect, rtol=1e-6, atol=0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))  # under the limit: untouched
    norm = clip_grad_norm(params, 0.5)
    scale = (0.5 / (norm + 1e-6)).clamp(max=1.0)
    assert float(scale) < 1.0
    for p, g in zip(params, before):  # over it: each gradient times the same scale, in its own dtype
        assert torch.equal(p.grad, g * scale.to(g.dtype))


def test_clip_grad_norm_is_accurate_for_large_cpu_gradients_and_clips_uncounted_copies():
    from hyperpar.train.optim import clip_grad_norm

    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.empty(4 * 1024 * 1024 + 3))  # torch's own fp32 norm: ~8e-5 off here
    big.grad = torch.randn_like(big)
    small = torch.nn.Parameter(torch.empty(100))
    small.grad = torch.randn_like(small)
    exact = torch.cat([big.grad, small.grad]).double().norm()
    norm = clip_grad_norm([big, small], 0.0)
    assert abs(norm.double() - exact) / exact < 1e-6
    copy = torch.nn.Parameter(torch.empty(100))  # a second copy of a shared weight: clipped, not counted
    copy.grad = small.grad.clone()
    norm = clip_grad_norm([big, small], 1.0, uncounted=[copy])
    assert abs(norm.double() - exact) / exact < 1e-6
    assert torch.equal(copy.grad, small.grad) and float(small.grad.norm()) < 1e-1
