"""train.compile: fsdp2 with compiled decoder blocks (and full activation checkpointing), context,
expert and pipeline parallel with compiled blocks train like the eager single process, loss, aux loss
and gradient norm per step within 1e-5; compiled tensor-parallel blocks give every parameter the
gradient of one eager process; layouts it is not built for are refused by the plan."""

from __future__ import annotations

import re

import pytest

from helpers import cli_metrics, cli_metrics_shared, cli_small, one_error_line, strict_steps
from layout_grads import assert_same_step, layout_grads

# MoE: compiled kernels round differently; held per step up to a near-tied token's route (strict_steps)
ROUTES = ["metrics.route_counts=true"]


@pytest.mark.slow
def test_compiled_fsdp2_with_ac_matches_eager_single(tmp_path):
    base = ["model=qwen3_5_moe", "model.mtp_loss_weight=0.3", "train.seq_len=64", *ROUTES]
    eager = cli_metrics(tmp_path / "eager", [*base, "parallel=single"], steps=4)
    compiled = cli_metrics(tmp_path / "compiled", [*base, "parallel=fsdp2", "train.compile=true",
                                                   "train.activation_checkpoint=full"], steps=4)
    log = (tmp_path / "compiled" / "logs" / "rank_0.log").read_text()
    assert re.search(r"train\.compile: [1-9]\d* decoder blocks compiled", log), log[-2000:]
    strict = strict_steps(eager, compiled)
    assert strict, "routes part at step 1"
    for s in strict:
        for key in ("loss", "aux_loss", "mtp_loss"):
            assert abs(eager[s][key] - compiled[s][key]) <= 1e-5, (s, key, eager[s][key], compiled[s][key])
    assert all(abs(eager[s]["loss"] - compiled[s]["loss"]) <= 2e-2 for s in eager)
    assert eager[1]["loss"] != eager[4]["loss"]


# CI runs one layout per family: cp over packed documents (dense) and ep inside pipeline stages (MoE).
@pytest.mark.slow
@pytest.mark.parametrize(("base", "layout"), [
    (["model=qwen3_5", "data=json"], "cp2"),
    (["model=qwen3_5_moe"], "ep2_pp2"),
    pytest.param(["model=qwen3_5_moe"], "pp2_vpp2", marks=pytest.mark.full),
    pytest.param(["model=qwen3_5_moe"], "fsdp2_cp2_ep2", marks=pytest.mark.full),
    pytest.param(["model=qwen3_vl_moe"], "cp2", marks=pytest.mark.full),
    pytest.param(["model=qwen3_vl_moe"], "fsdp_tp2", marks=pytest.mark.full),
], ids=["dense_cp2_packed", "moe_ep2_pp2", "moe_pp2_vpp2", "moe_fsdp2_cp2_ep2", "vl_moe_cp2", "vl_moe_fsdp_tp2"])
def test_compiled_model_parallel_layouts_match_eager_single(tmp_path, base, layout):
    base = [*base, "train.seq_len=64", *(ROUTES if "moe" in base[0] else [])]
    eager = cli_metrics_shared(tmp_path / "eager", [*base, "parallel=single"], steps=4)
    compiled = cli_metrics(tmp_path / "compiled", [*base, f"parallel={layout}", "train.compile=true"], steps=4)
    logs = "".join(p.read_text() for p in (tmp_path / "compiled" / "logs").glob("rank_*.log"))
    assert re.search(r"train\.compile: [1-9]\d* decoder blocks compiled", logs), logs[-2000:]
    assert sorted(eager) == sorted(compiled) == [1, 2, 3, 4]
    assert all(abs(eager[s]["loss"] - compiled[s]["loss"]) <= 2e-2 for s in eager)
    strict = strict_steps(eager, compiled)
    assert strict, "routes part at step 1"
    for s in strict:
        for key in ("loss", "aux_loss", "grad_norm"):
            if key in eager[s]:
                assert abs(eager[s][key] - compiled[s][key]) <= 1e-5 * max(1.0, abs(eager[s][key])), \
                    (s, key, eager[s][key], compiled[s][key])
    assert eager[1]["loss"] != eager[4]["loss"]


TP_BASE = ["model=qwen3_5", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1"]


@pytest.mark.slow
def test_compiled_tensor_parallel_gradients_equal_one_process(tmp_path, monkeypatch):
    """Compiled tp2 blocks with SP: every parameter's gradient equals eager single's. The first
    block's input arrives from the embedding's asynchronous collective (its gradient went wrong when
    the wait was traced into the block), and tp2 runs twice over one fresh compile cache, so the
    second run loads what the first stored (a rank loaded another rank's compiled backward)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ref = layout_grads(["parallel=single", *TP_BASE], 1)
    for run in range(2):
        got = layout_grads(["parallel=tp2", "train.compile=true", *TP_BASE], 2)
        assert_same_step(ref, got, f"compiled tp2 run {run}")


@pytest.mark.full
def test_compiled_tensor_parallel_without_sp_gradients_equal_one_process(tmp_path, monkeypatch):
    """Compiled tp2 blocks without SP (replicated block inputs)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ref = layout_grads(["parallel=single", *TP_BASE], 1)
    got = layout_grads(["parallel=tp2", "train.compile=true", "parallel.sequence_parallel=false", *TP_BASE], 2)
    assert_same_step(ref, got, "compiled tp2 without SP")


@pytest.mark.parametrize(("extra", "message"), [
    (["parallel=pp2_zb"], "train.compile with pp_schedule=zero_bubble not supported"),
    (["train.activation_checkpoint=selective"], "train.compile with activation_checkpoint=selective not supported"),
])
def test_compile_refused_where_not_built(tmp_path, extra, message):
    res = cli_small(tmp_path / "run", ["train.compile=true", *extra])
    assert res.returncode == 2 and message in one_error_line(res), res.stderr[-2000:]
