"""Crash recovery (elastic restart + automatic resume) and preemption (SIGTERM: save, exit 0).

Crashes are injected with the worker's test hooks (hyperpar/checkpoint/preemption.py):
``HYPERPAR_TEST_KILL_AT_STEP`` / ``HYPERPAR_TEST_SIGNAL_AT_STEP`` act on the first attempt only.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import CKPT, SMALL
from helpers import cli_env, cli_small, records, run_small, steps_logged
from hyperpar.checkpoint import directory as d


@pytest.fixture(scope="module")
def fsdp2_base(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fsdp2") / "base"
    res = cli_small(run, ["parallel=fsdp2"])
    assert res.returncode == 0, res.stderr[-3000:]
    return run


@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_resumes(fsdp2_base, tmp_path):
    run = tmp_path / "run"
    res = cli_small(run, ["parallel=fsdp2", *CKPT, "launch.max_restarts=1"], env={"HYPERPAR_TEST_KILL_AT_STEP": "7"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "terminated with signal SIGKILL" in res.stderr  # rank 1 really died ...
    log0 = (run / "logs" / "rank_0.log").read_text()
    assert "resumed from" in log0 and "step_5 at step 5" in log0  # ... and the restarted workers resumed
    logged = steps_logged(run)
    assert logged[:5] == [1, 2, 3, 4, 5] and logged[-15:] == list(range(6, 21)) and logged.count(6) == 2
    assert records(run) == records(fsdp2_base)  # deduplicated by step: the uninterrupted run, bitwise


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_all_ranks_after_the_same_step(fsdp2_base, tmp_path):
    run = tmp_path / "run"
    env = {"HYPERPAR_TEST_SIGNAL_AT_STEP": "3", "HYPERPAR_TEST_SIGNAL": "TERM", "HYPERPAR_TEST_SIGNAL_RANK": "1"}
    res = cli_small(run, ["parallel=fsdp2", *CKPT], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):  # rank 0 never got the signal; the all-reduced flag stopped it too
        assert "stopping after step 3 of 20 (preempted)" in (run / "logs" / f"rank_{rank}.log").read_text()
    assert steps_logged(run) == [1, 2, 3]
    step3 = run / "checkpoints" / "step_3"
    assert d.is_complete(step3) and len(list((step3 / "rng").iterdir())) == 2
    res = cli_small(run, ["parallel=fsdp2", *CKPT])
    assert res.returncode == 0, res.stderr[-3000:]
    assert records(run) == records(fsdp2_base)


def _sigterm_when_training(args: list[str], run: Path, after_steps: int = 3) -> tuple[subprocess.CompletedProcess, float]:
    run.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar", *args, f"hydra.run.dir={run}"], cwd=run.parent,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
            break
        time.sleep(0.05)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.time() - sent


def test_sigterm_single_process_saves_exits_zero_and_resumes_exactly(tmp_path):
    long = ["train.steps=400"]  # long enough that the signal always lands mid-training
    run = tmp_path / "run"
    res, _ = _sigterm_when_training([*SMALL, *long, "checkpoint=default", "checkpoint.save_steps=0"], run)
    assert res.returncode == 0, res.stderr[-3000:]
    last = steps_logged(run)[-1]
    assert 3 <= last < 400
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [last]
    # Resume for two more steps; a fresh run stopped at the same step must agree bitwise.
    run_small(run, [*long, "checkpoint=default", "checkpoint.save_steps=0", f"train.stop_after_steps={last + 2}"])
    assert steps_logged(run) == list(range(1, last + 3))
    fresh = tmp_path / "fresh"
    run_small(fresh, [*long, f"train.stop_after_steps={last + 2}"])
    assert records(run) == records(fresh)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    """Preemption of a multi-process run: the elastic agent forwards SIGTERM; the workers finish the step,
    save and leave well within the agent's shutdown timeout (30 s)."""
    run = tmp_path / "run"
    res, took = _sigterm_when_training([*SMALL, "train.steps=400", "parallel=fsdp2", "checkpoint=default",
                                        "checkpoint.save_steps=0"], run)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "preempted (SIGTERM)" in res.stdout + res.stderr  # the driver logs through Hydra (stdout)
    assert "Unable to shutdown process" not in res.stderr and took < 25, took
    last = steps_logged(run)[-1]
    ckpt = run / "checkpoints" / f"step_{last}"
    assert d.is_complete(ckpt) and len(list((ckpt / "rng").iterdir())) == 2
    assert json.loads((ckpt / "train_state.json").read_text())["counters"]["step"] == last
