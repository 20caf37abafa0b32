"""bf16 mixed precision: 1 process and fsdp2 agree in mean loss over 100 steps (bound 5e-3), and the
one-process run casts like the N-process run (FSDP's mixed-precision policy; on CPU applied without
FSDP by ``one_rank_cast``, bitwise the same: tests/test_one_rank_cast.py)."""

from __future__ import annotations

import json

import pytest

from helpers import read_losses, run_cli

pytestmark = pytest.mark.slow


def test_bf16_single_vs_fsdp2_mean_loss(tmp_path):
    # seq 64 x 4 rows (a quarter of the default step) keeps the 2 x 100 steps inside CI's budget.
    common = ["train.steps=100", "train.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2",
              "train.mixed_precision.param_dtype=bfloat16", "train.mixed_precision.reduce_dtype=float32"]
    dirs = {}
    for layout in ("single", "fsdp2"):
        dirs[layout] = tmp_path / layout
        res = run_cli([f"parallel={layout}", *common, f"hydra.run.dir={dirs[layout]}"], cwd=tmp_path, timeout=1200)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_losses(dirs["single"]), read_losses(dirs["fsdp2"])
    assert len(a) == len(b) == 100
    mean_a, mean_b = sum(a.values()) / 100, sum(b.values()) / 100
    print(f"bf16 mean loss over 100 steps: single {mean_a:.5f}, fsdp2 {mean_b:.5f}, first {a[1]:.3f} last {a[100]:.3f}")
    assert abs(mean_a - mean_b) <= 5e-3, (mean_a, mean_b)
    assert json.loads((dirs["fsdp2"] / "result.json").read_text())["param_dtype"] == "bfloat16"
    # The model learned something: bf16 must not be a no-op run.
    assert a[100] < a[1] - 0.5
