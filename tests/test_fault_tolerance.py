"""Crash recovery (elastic restart + automatic resume) and preemption (SIGTERM: save, exit 0).

Crashes are injected with the worker's test hooks (hyperpar/checkpoint/preemption.py):
``HYPERPAR_TEST_KILL_AT_STEP`` / ``HYPERPAR_TEST_SIGNAL_AT_STEP`` act on the first attempt only.
"""

from __future__ import annotations

import contextlib
import json
import os
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
    # the killed attempt's step 6 moved aside when the restart resumed from step 5
    assert logged == list(range(1, 21)) and '"step": 6' in (run / "metrics.abandoned.jsonl").read_text()
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


def _sigterm_when_training(args: list[str], run: Path, after_steps: int = 3,
                           sig: int = signal.SIGTERM) -> tuple[subprocess.CompletedProcess, float]:
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
    proc.send_signal(sig)
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


def test_driver_watch_fires_when_the_watched_process_dies():
    from hyperpar import driver_watch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fired = []
    thread = driver_watch.watch(proc.pid, lambda: fired.append(time.time()), poll_s=0.05)
    time.sleep(0.3)
    assert not fired and thread.is_alive()
    proc.kill()
    proc.wait()
    thread.join(timeout=10)
    assert fired and driver_watch.gone()


def _group_pids(pgid: int) -> set[int]:
    """Live processes of process group ``pgid`` (the driver's session: its workers, fork server, tracker)."""
    out = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.add(int(p.name))
    return out


@pytest.mark.slow
def test_sigkilled_driver_stops_its_workers_after_saving(tmp_path):
    """kill -9 of the driver (OOM killer, a hard kill): its workers used to train on unsupervised, writing into a
    run dir whose lock was gone, then wait forever for the dead agent. Now they stop as on SIGTERM: save, exit."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    args = [*SMALL, "train.steps=400", "parallel=fsdp2", "checkpoint=default", "checkpoint.save_steps=0"]
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar", *args, f"hydra.run.dir={run}"], cwd=run.parent,
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert len(_group_pids(proc.pid) - {proc.pid}) >= 2  # the workers (and the fork server)
    proc.kill()
    proc.wait()
    deadline = time.time() + 40
    while time.time() < deadline and _group_pids(proc.pid):
        time.sleep(0.2)
    left = _group_pids(proc.pid)
    for pid in left:  # never leave them behind, even when the check fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} of the run outlived the driver"
    last = steps_logged(run)[-1]
    assert last < 400
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [last]


def test_launcher_failure_record_is_one_line_or_dropped():
    """torch's elastic launcher logs a failed worker with a traceback of its own polling code."""
    import logging

    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from hyperpar.launch import _WorkerExitFilter

    def record(exc):
        try:
            raise exc
        except (ProcessExitedException, ProcessRaisedException):
            return logging.LogRecord("torch", logging.ERROR, "api.py", 836, "failed (exitcode: %s) local_rank: %s",
                                     (getattr(exc, "exit_code", 1), exc.error_index), sys.exc_info())

    f = _WorkerExitFilter()
    user = record(ProcessExitedException("process 0 terminated with exit code 2", error_index=0, error_pid=1, exit_code=2))
    assert not f.filter(user)  # the worker's one-line user error is reported by the driver
    killed = record(ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=1,
                                           exit_code=-9, signal_name="SIGKILL"))
    assert f.filter(killed) and killed.exc_info is None
    assert killed.getMessage() == "failed (exitcode: -9) local_rank: 1: process 1 terminated with signal SIGKILL"
    # a worker that raised: its own traceback stays (it was cut to torch's header line, and the driver's one line
    # said "its traceback is above")
    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: a bug"
    raised = record(ProcessRaisedException(f"\n\n-- Process 0 terminated with the following error:\n{trace}", 0, 1))
    assert f.filter(raised) and raised.exc_info is None
    assert raised.getMessage().endswith(f"-- Process 0 terminated with the following error:\n{trace}")


def _error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if " error: " in ln and not ln.startswith(("E1", "W1", "I1"))]


@pytest.mark.slow
def test_worker_errors_are_one_line_under_the_launcher(tmp_path):
    """A user error raised in the workers (here a non-finite loss) was printed by every rank and the driver, after
    a dozen lines of the launcher's traceback; a worker killed by a signal ended in a 60-line traceback (exit 1).
    A user error is not retried by launch.max_restarts: each restart used to redo the steps and fail the same way."""
    res = cli_small(tmp_path / "nan", ["parallel=fsdp2", "optim.lr=1e30", "optim.warmup_steps=0", "launch.max_restarts=2"])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert _error_lines(res) == ["training error: non-finite loss at step 2: loss=nan, grad_norm=nan (hint: lower "
                                 "optim.lr, enable clipping (train.max_grad_norm) or use float32)"], res.stderr[-3000:]
    assert steps_logged(tmp_path / "nan") == [1]  # step 1 once: the restarts exited at once
    res = cli_small(tmp_path / "kill", ["parallel=fsdp2"], env={"HYPERPAR_TEST_KILL_AT_STEP": "2"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = _error_lines(res)
    assert len(lines) == 1 and lines[0].startswith("worker error: worker rank 1 died of SIGKILL"), res.stderr[-3000:]
    assert json.loads((tmp_path / "kill" / "result.json").read_text())["error"] == lines[0]


def test_non_finite_loss_stops_on_its_step_and_result_json_names_the_last_step_done(tmp_path, capfd):
    """The loss goes NaN at step 2 (lr 1e30): one line naming step 2, exit 2, the step-1 checkpoint the resume
    point (no step-2 state saved), and result.json's `step` the last step done (it was null on failures)."""
    from helpers import run_entry

    run = tmp_path / "run"
    code, lines = run_entry("hyperpar", [*SMALL, "train.steps=4", "optim.lr=1e30", "optim.warmup_steps=0",
                                         "metrics.progress_bar=false", "checkpoint=default", "checkpoint.save_steps=1",
                                         f"hydra.run.dir={run}"], capfd)
    assert code == 2 and lines[-1].startswith("training error: non-finite loss at step 2: loss=nan"), lines
    assert not any("Traceback" in ln for ln in lines)
    assert steps_logged(run) == [1]
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [1]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "failed" and result["step"] == 1


def test_a_step_that_overflows_the_weights_is_never_saved(tmp_path, capfd):
    """lr 1e38: step 1's loss and gradients are finite, its AdamW update (10 x lr in the first step) makes the
    weights inf. That checkpoint used to be saved, pass verification and be resumed, failing again at once."""
    from helpers import run_entry

    run = tmp_path / "run"
    code, lines = run_entry("hyperpar", [*SMALL, "train.steps=4", "optim.lr=1e38", "optim.warmup_steps=0",
                                         "metrics.progress_bar=false", "checkpoint=default", "checkpoint.save_steps=1",
                                         f"hydra.run.dir={run}"], capfd)
    assert code == 2 and lines[-1].startswith("training error: parameters became non-finite in the optimizer step "
                                              "of step 1"), lines
    assert "checkpoint step_1 not saved" in lines[-1]
    assert not (run / "checkpoints").exists() or d.list_complete(run / "checkpoints") == []


def test_sigterm_before_training_exits_zero_with_a_line(tmp_path):
    """SIGTERM while the driver composes / plans / verifies (before any training loop or elastic agent holds the
    signal) killed it silently with exit 143; preemption promises exit 0 and a line saying what happened."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar", *SMALL, "parallel=fsdp2", f"hydra.run.dir={run}"],
                            cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (run / ".hyperpar.lock").exists():  # taken in the driver's preflight
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted (SIGTERM)" in out + err and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_saves_and_exits_130_without_the_shutdown_timeout(tmp_path):
    """SIGINT to the driver of a multi-process run: the workers saved within a second, then waited for the
    shutting-down agent to read their result until it SIGKILLed them 30 s later ("Unable to shutdown process")."""
    run = tmp_path / "run"
    res, took = _sigterm_when_training([*SMALL, "train.steps=400", "parallel=fsdp2", "checkpoint=default",
                                        "checkpoint.save_steps=0"], run, sig=signal.SIGINT)
    assert res.returncode == 130, res.stderr[-3000:]
    assert "stopped (Ctrl-C)" in res.stdout + res.stderr
    assert "Unable to shutdown process" not in res.stderr and took < 25, (took, res.stderr[-3000:])
    last = steps_logged(run)[-1]
    assert d.is_complete(run / "checkpoints" / f"step_{last}")
    assert json.loads((run / "result.json").read_text())["status"] == "stopped"
    assert f"stopping after step {last} of 400 (stopped)" in (run / "logs" / "rank_0.log").read_text()  # was "(preempted)"


def test_worker_user_error_reaches_the_driver_even_before_the_job_starts(tmp_path, monkeypatch, capfd):
    """The driver reports a worker's user error from user_error.txt (the workers no longer print it each);
    an error raised before worker_main's own handler (device, process group) must land there too."""
    from hyperpar import launch
    from hyperpar.errors import ConfigError

    def fail(cfg, run_dir):
        raise ConfigError("device=cuda but no CUDA device is visible", hint="device=cpu")

    monkeypatch.setattr(launch, "worker_main", fail)
    monkeypatch.delenv("HYPERPAR_DRIVER_PID", raising=False)
    monkeypatch.setenv("HYPERPAR_WORKER", "1")  # run_worker sets it: restored after the test
    (tmp_path / "config.yaml").write_text("launch: {monitor_interval: 1}\n")
    with pytest.raises(SystemExit) as exc:
        launch.run_worker(str(tmp_path / "config.yaml"), str(tmp_path))
    assert exc.value.code == 2
    line = (tmp_path / launch.USER_ERROR_FILE).read_text().strip()
    assert line == "config error: device=cuda but no CUDA device is visible (hint: device=cpu)"
    assert type(launch._user_error(line)) is ConfigError
