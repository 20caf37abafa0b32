"""MoE route records (models/layers/moe.py record_routes, train/routes.py): what each step's routers
chose, as layout-independent metrics (route_hash, route_margin, route_counts)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hyperpar.models.layers.moe import RouteRecord, SparseMoeBlock, record_router_stats, record_routes, top_k_margin
from hyperpar.train.routes import RouteMonitor, route_keys

from helpers import cli_metrics

torch.set_num_threads(1)


def test_top_k_margin_is_the_smallest_gap_between_chosen_and_not_chosen():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05],   # top-2 {0, 1}: 0.3 - 0.15
                          [0.1, 0.4, 0.25, 0.25],   # top-2 {1, 2}: 0.25 - 0.25 = 0 (an exact tie)
                          [0.7, 0.1, 0.1, 0.1]])    # top-2 {0, one of the 0.1s}: 0
    top = torch.topk(probs, 2, dim=-1).indices
    assert top_k_margin(probs[:1], top[:1]).item() == pytest.approx(0.15)
    assert top_k_margin(probs, top).item() == 0.0
    # padding is left out, and a token's own choice decides (not a sorted probability)
    assert top_k_margin(probs, top, torch.tensor([1, 0, 0])).item() == pytest.approx(0.15)
    assert top_k_margin(probs[:1], torch.tensor([[0, 2]])).item() == pytest.approx(0.15 - 0.3)
    assert top_k_margin(probs, torch.topk(probs, 4, dim=-1).indices) is None  # every expert chosen
    assert top_k_margin(probs[:0], top[:0]) is None


def _block(key: str | None = "model.layers.0.mlp") -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(16, num_experts=4, top_k=2, moe_intermediate_size=8)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    block.route_key = key
    return block


def test_a_block_records_its_routes_inside_the_stats_context_only():
    """The forward that publishes router statistics records; a checkpoint's recomputation (outside
    record_router_stats) and an unnamed block do not."""
    block = _block()
    x = torch.randn(2, 5, 16, requires_grad=True)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0  # two padded positions
    with record_routes() as rec:
        with record_router_stats() as stats:
            out = checkpoint(block, x, mask, use_reentrant=False)
        out.sum().backward()  # recomputes the block: no second record
    counts = rec.counts["model.layers.0.mlp"]
    assert counts.tolist() == stats[0].counts.tolist() and counts.sum().item() == 8 * 2
    probs = torch.softmax(x.detach().reshape(-1, 16) @ block.gate.weight.detach().t(), -1)
    want = top_k_margin(probs, torch.topk(probs, 2, dim=-1).indices, mask)
    assert torch.allclose(rec.margin, want)

    with record_routes() as rec:
        block(x)  # no stats context: a recomputation
        with record_router_stats():
            _block(key=None)(x)  # no name
    assert rec.counts == {} and rec.margin is None


def test_monitor_counts_tensor_parallel_replicas_once_and_hashes_the_counts():
    block = _block()
    keys = route_keys([torch.nn.Sequential(block)])
    assert keys == {"0": 4} and block.route_key == "0"
    rec = RouteRecord({"0": torch.tensor([3.0, 1.0, 0.0, 4.0])}, torch.tensor(2e-7))
    one = RouteMonitor(["0"], {"0": 4}, tp=1, device=torch.device("cpu"), counts=True).summary(rec)
    twice = RouteRecord({"0": torch.tensor([6.0, 2.0, 0.0, 8.0])}, torch.tensor(2e-7))
    two = RouteMonitor(["0"], {"0": 4}, tp=2, device=torch.device("cpu"), counts=True).summary(twice)
    assert one == two
    assert one["route_counts"] == {"0": [3, 1, 0, 4]} and one["route_margin"] == pytest.approx(2e-7)
    assert one["route_max_load"] == pytest.approx(4 / (8 / 4))  # the busiest expert over the mean
    want = hashlib.blake2b(torch.tensor([3, 1, 0, 4], dtype=torch.int64).numpy().tobytes(), digest_size=8).hexdigest()
    assert one["route_hash"] == want
    quiet = RouteMonitor(["0"], {"0": 4}, tp=1, device=torch.device("cpu")).summary(RouteRecord({}))
    assert "route_counts" not in quiet and quiet["route_margin"] is None and quiet["route_max_load"] is None
    two_blocks = RouteMonitor(["a", "b"], {"a": 2, "b": 2}, tp=1, device=torch.device("cpu")).summary(
        RouteRecord({"a": torch.tensor([5.0, 5.0]), "b": torch.tensor([9.0, 1.0])}))
    assert two_blocks["route_max_load"] == pytest.approx(1.8)  # block b: 9 over a mean of 5


def test_blocks_are_ordered_as_a_forward_meets_them():
    m = RouteMonitor.for_model([torch.nn.ModuleDict({str(i): _block() for i in (0, 2, 10)})], 1, torch.device("cpu"))
    assert m.keys == ["0", "2", "10"]
    assert RouteMonitor.for_model([torch.nn.Linear(2, 2)], 1, torch.device("cpu")) is None


def test_an_moe_run_logs_its_routes_and_a_dense_run_does_not(tmp_path):
    moe = cli_metrics(tmp_path / "moe", ["model=qwen3_5_moe", "model.mtp_loss_weight=0.3", "parallel=single",
                                         "metrics.route_counts=true"], steps=2)
    for rec in moe.values():
        counts = rec["route_counts"]
        assert list(counts) == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp",
                                "model.layers.3.mlp", "mtp.layers.0.mlp"]
        # every labelled position is routed to top-k experts in each block (the MTP block sees one row fewer)
        per_block = [sum(c) for c in counts.values()]
        assert len(set(per_block[:4])) == 1 and per_block[4] < per_block[0]
        assert len(rec["route_hash"]) == 16 and 0 <= rec["route_margin"] < 1
        assert 1 <= rec["route_max_load"] <= 8 / 2  # debug MoE: 8 experts, top-2
    assert moe[1]["route_hash"] != moe[2]["route_hash"]
    dense = cli_metrics(tmp_path / "dense", ["model=qwen3_5", "parallel=single"], steps=1)
    assert not {"route_hash", "route_margin", "route_counts"} & set(dense[1])
