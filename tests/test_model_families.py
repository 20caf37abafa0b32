"""Every model family trains through the real CLI: N-process parity sweeps and activation
checkpointing equal to none, under single and fsdp2 (fp32)."""

from __future__ import annotations

import json

import pytest

from helpers import read_losses, run_cli

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_vl_moe"]


# hsdp2x2 (4 processes) for one family in the default run: the layouts shard every family alike
@pytest.mark.parametrize(("model", "layouts"), [("qwen3_5_moe", "single,fsdp2,hsdp2x2"), ("qwen3_vl_moe", "single,fsdp2"),
                                                pytest.param("qwen3_vl_moe", "single,fsdp2,hsdp2x2", marks=pytest.mark.full)])
def test_parity_sweep_moe_families(tmp_path, model, layouts):
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", f"model={model}", f"parallel={layouts}", "+experiment=parity", "train.steps=10",
                   f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((sweep / "parity.json").read_text())
    assert report["passed"] is True
    base = read_losses(sweep / "0")
    for job in range(1, layouts.count(",") + 1):
        other = read_losses(sweep / str(job))
        assert max(abs(other[s] - base[s]) for s in base) <= 1e-5
    # The MoE aux loss is part of the objective and logged on its own.
    first = json.loads((sweep / "0" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["aux_loss"] > 0


# AC wraps every family's blocks the same way: in the default run the VL MoE family on one process and
# the text MoE family under FSDP; every other family and layout under the `full` marker.
@pytest.mark.parametrize(("model", "layout"), [
    *((m, "single") if m == "qwen3_vl_moe" else pytest.param(m, "single", marks=pytest.mark.full) for m in FAMILIES),
    ("qwen3_5_moe", "fsdp2"),
    *(pytest.param(m, "fsdp2", marks=pytest.mark.full) for m in FAMILIES if m != "qwen3_5_moe"),
])
def test_activation_checkpoint_equals_none(tmp_path, model, layout):
    losses = {}
    for mode in ("none", "full", "selective"):
        d = tmp_path / mode
        res = run_cli([f"model={model}", f"parallel={layout}", "train.steps=3", f"train.activation_checkpoint={mode}",
                       f"hydra.run.dir={d}"], cwd=tmp_path, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        losses[mode] = read_losses(d)
    assert losses["full"] == losses["none"]
    assert losses["selective"] == losses["none"]
