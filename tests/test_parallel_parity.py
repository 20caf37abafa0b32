"""N-process training equals 1-process training (fp32, per step <= 1e-5), through the real CLI.

These start real worker processes (gloo on CPU); each proves something one process cannot. The first
test is small enough for the fast suite, so ``pytest -m "not slow"`` still checks N ranks = 1 rank.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures import SMALL
from helpers import cli_env, read_losses, run_cli


def test_two_ranks_match_one_rank(tmp_path):
    """Fast: tiny runs, 3 steps, single vs FSDP over 2 processes through a parity sweep."""
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single,fsdp2", "+experiment=parity", *SMALL, "train.steps=3",
                   f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    base, fsdp = read_losses(sweep / "0"), read_losses(sweep / "1")
    assert sorted(base) == sorted(fsdp) == [1, 2, 3]
    assert max(abs(base[s] - fsdp[s]) for s in base) <= 1e-5
    assert base[1] != base[3]  # the weights changed: equal losses are not a stuck run
    assert json.loads((sweep / "parity.json").read_text())["passed"] is True


@pytest.mark.full
def test_fsdp_units_kept_gathered_match_one_rank(tmp_path):
    """parallel.fsdp_reshard_after_forward=false: no second all-gather in the backward, same losses."""
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single,fsdp2", "parallel.fsdp_reshard_after_forward=false", "+experiment=parity", *SMALL,
                   "train.steps=3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    base, fsdp = read_losses(sweep / "0"), read_losses(sweep / "1")
    assert max(abs(base[s] - fsdp[s]) for s in base) <= 1e-5 and base[1] != base[3]


@pytest.mark.slow
def test_parity_sweep_all_dp_layouts(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single,ddp2,fsdp2,fsdp4,hsdp2x2", "+experiment=parity", "train.steps=8",
                   f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("parity.md", "parity.json", "parity.png"):
        assert (sweep / name).stat().st_size > 0
    report = json.loads((sweep / "parity.json").read_text())
    assert report["passed"] is True
    base = read_losses(sweep / "0")
    assert len(base) == 8
    for job in range(1, 5):
        losses = read_losses(sweep / str(job))
        assert sorted(losses) == sorted(base)
        worst = max(abs(losses[s] - base[s]) for s in base)
        assert worst <= 1e-5, (job, worst)
    assert "PASS" in (sweep / "parity.md").read_text()


@pytest.mark.slow
def test_parity_sweep_fails_when_a_job_diverges(tmp_path):
    """The sweep must be able to fail: a job with another seed, compared with the first job (named:
    unnamed, each seed has its own 1-process baseline), is outside tolerance -> non-zero exit."""
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single", "train.seed=1,2", "train.steps=3", "+experiment=parity",
                   "parity.baseline='train.seed=1'", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert res.returncode != 0
    report = json.loads((sweep / "parity.json").read_text())
    assert report["passed"] is False


@pytest.mark.slow
def test_parity_cli_rebuilds_report_from_run_dirs(tmp_path):
    runs = []
    for layout in ("single", "fsdp2"):
        d = tmp_path / layout
        res = run_cli([f"parallel={layout}", "train.steps=4", f"hydra.run.dir={d}"], cwd=tmp_path, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(str(d))
    out = tmp_path / "report"
    res = run_cli([*runs, "--out", str(out)], cwd=tmp_path, module="hyperpar.parity", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((out / "parity.json").read_text())["passed"] is True


@pytest.mark.slow
def test_torchrun_uses_one_run_dir_and_matches_in_process_launch(tmp_path):
    # `python -m torch.distributed.run` is torchrun itself, so this needs no torchrun on PATH.
    torchrun_dir = tmp_path / "tr"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hyperpar",
                          "parallel=fsdp2", "train.steps=3", "launch.max_restarts=1", f"hydra.run.dir={torchrun_dir}"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (torchrun_dir / "logs" / "rank_1.log").exists()
    assert json.loads((torchrun_dir / "result.json").read_text())["status"] == "completed"
    assert (torchrun_dir / "config.yaml").is_file()  # the resolved config, as under our launcher (export reads it)
    # Restarts are torchrun's own flag there: one line says so (from rank 0 only).
    note = "launch.max_restarts=1 has no effect under an external torchrun"
    assert res.stderr.count(note) == 1, res.stderr[-3000:]
    own = tmp_path / "own"
    res = run_cli(["parallel=fsdp2", "train.steps=3", f"hydra.run.dir={own}"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_losses(torchrun_dir) == read_losses(own)
