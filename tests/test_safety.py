"""Nothing a user does or a machine suffers corrupts a run (issue 14).

Each test reproduces one defect: a damaged checkpoint of the right size, auto-resume without a
fallback, ``load_path`` losing to ``resume=auto``, retention deleting the good checkpoint, code in a
checkpoint's ``.metadata``, two runs in one run dir, a refused resume rewriting the run dir,
SIGTERM/SIGINT recorded as "completed", a full disk during a save, converter leftovers. One process,
tiny runs (4 steps of 4 x 16 tokens), in-process where signals and exits allow.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import SMALL
from helpers import cli_env, cli_small, records, run_entry, run_small, steps_logged
from hyperpar.checkpoint import directory as d
from hyperpar.checkpoint import integrity
from hyperpar.errors import CheckpointError, ConfigError

CKPT = ["checkpoint=default", "checkpoint.save_steps=2", "checkpoint.keep_last=0"]
STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 4-step run with complete checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("safety") / "base"
    run_small(run, CKPT, steps=STEPS)
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [2, 4]
    return run


def copy_run(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst)
    return dst


def corrupt(path: Path, offset: int = 65536, n: int = 4096) -> None:
    """Overwrite ``n`` bytes with 0xff in place: same size, same name, garbage inside."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * n)


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step}"


# ---- checksums ---------------------------------------------------------------------------------------
def test_save_records_a_checksum_of_every_file(base):
    marker = json.loads((ckpt(base, 4) / d.MARKER).read_text())
    files = marker["files"]
    assert marker["checksum"] == "crc32"
    assert {".metadata", "__0_0.distcp", "train_state.json", "config.yaml", "rng/rank_00000.json"} <= set(files)
    assert files["__0_0.distcp"]["size"] == (ckpt(base, 4) / "__0_0.distcp").stat().st_size
    assert files["__0_0.distcp"]["crc32"] == integrity.file_crc32(ckpt(base, 4) / "__0_0.distcp")


def test_corrupt_data_file_of_the_same_size_is_refused_by_resume_and_export(base, tmp_path, capfd):
    run = copy_run(base, tmp_path / "run")
    corrupt(ckpt(run, 4) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp' is corrupt: its crc32 checksum"):
        run_small(tmp_path / "other", [*CKPT, f"checkpoint.load_path={ckpt(run, 4)}"], steps=STEPS)
    rc, lines = run_entry("hyperpar.export", [str(ckpt(run, 4)), str(tmp_path / "hf")], capfd)
    assert rc == 2 and len(lines) == 1 and "__0_0.distcp' is corrupt" in lines[0], lines
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(base, tmp_path, hyperpar_log):
    run = copy_run(base, tmp_path / "run")
    corrupt(ckpt(run, 4) / "__0_0.distcp")
    run_small(run, [*CKPT, "checkpoint.resume=auto"], steps=STEPS)
    err = "\n".join(hyperpar_log)
    assert err.count("skipping checkpoint step_4: checkpoint file") == 1 and "is corrupt" in err, err
    assert "using step_2, the newest intact checkpoint (skipped step_4)" in err
    assert records(run) == records(base)  # steps 3-4 re-run from step_2: the same trajectory, bitwise
    d.verify_checkpoint(ckpt(run, 4))  # and the re-saved step_4 is intact


def test_auto_resume_with_every_checkpoint_damaged_is_one_error(base, tmp_path):
    run = copy_run(base, tmp_path / "run")
    for step in (2, 4):
        corrupt(ckpt(run, step) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*\(2 damaged; newest, step_4"):
        run_small(run, [*CKPT, "checkpoint.resume=auto"], steps=STEPS)


def test_explicit_load_path_wins_over_resume_auto(base, tmp_path):
    run = copy_run(base, tmp_path / "run")
    run_small(run, [*CKPT, "checkpoint.resume=auto", f"checkpoint.load_path={ckpt(run, 2)}", "train.stop_after_steps=3"],
              steps=STEPS)
    # Resumed at step 2 (not the newer step_4 of this run dir): step 3 ran again and was saved; the rewind moved
    # step_4 and the later metrics records aside.
    assert steps_logged(run) == [1, 2, 3] and d.is_complete(ckpt(run, 3)) and not ckpt(run, 4).exists()
    assert records(run)[3] == records(base)[3]


def test_retention_never_deletes_the_verified_checkpoint_while_keeping_a_damaged_newer_one(base, tmp_path):
    run = copy_run(base, tmp_path / "run")
    corrupt(ckpt(run, 4) / "__0_0.distcp")
    run_small(run, ["checkpoint=default", "checkpoint.save_steps=1", "checkpoint.keep_last=2", "checkpoint.resume=auto",
                    "train.stop_after_steps=3"], steps=STEPS)  # auto skips the damaged step_4, resumes step_2
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [2, 3, 4]
    d.verify_checkpoint(ckpt(run, 2))
    d.verify_checkpoint(ckpt(run, 3))


# ---- no code from checkpoint files -------------------------------------------------------------------
class _Payload:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_pickle_payload_in_metadata_never_runs_on_resume_or_export(base, tmp_path, capfd):
    target = shutil.copytree(ckpt(base, 4), tmp_path / "ckpts" / "step_4")
    flag = tmp_path / "pwned"
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(flag)))
    # An attacker rewrites the marker too, so the checksums pass and the unpickler is what stops it.
    marker = json.loads((target / d.MARKER).read_text())
    marker["files"].update(integrity.checksum_files(target, [".metadata"]))
    (target / d.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"asks to load '(posix|os)\.system'.*refused before running it"):
        run_small(tmp_path / "run", [*CKPT, f"checkpoint.load_path={target}"], steps=STEPS)
    rc, lines = run_entry("hyperpar.export", [str(target), str(tmp_path / "hf")], capfd)
    assert rc == 2 and len(lines) == 1 and "refused before running it" in lines[0], lines
    assert not flag.exists()


def test_safe_reader_refuses_pickled_values():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from hyperpar.checkpoint.safe_metadata import SafeFileSystemReader

    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("model.x"), dest_offsets=(), storage_index=MetadataIndex("model.x"),
                    storage_offsets=(), lengths=())
    with pytest.raises(CheckpointError, match="'model.x' as pickled bytes"):
        SafeFileSystemReader("/nonexistent").read_data(LoadPlan([item]), None)


# ---- the run dir ----------------------------------------------------------------------------------
def _start_long_run(run: Path) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "hyperpar", *SMALL, "train.steps=400", "checkpoint=default",
                             "checkpoint.save_steps=0", f"hydra.run.dir={run}"], cwd=run.parent, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_second_run_in_the_same_run_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    first = _start_long_run(run)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None and not (run / "metrics.jsonl").exists():
            time.sleep(0.1)
        assert first.poll() is None, first.communicate()[1][-3000:]
        hydra_cfg = (run / ".hydra" / "config.yaml").read_bytes()
        second = cli_small(run, ["train.steps=2"], timeout=300)
        lines = [ln for ln in (second.stdout + second.stderr).splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"run dir '{run}' is in use by another hyperpar run: pid {first.pid}" in lines[0], lines[0]
        assert (run / ".hydra" / "config.yaml").read_bytes() == hydra_cfg  # the second run wrote nothing
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 0
    assert json.loads((run / "result.json").read_text())["status"] == "preempted"


def test_lock_of_a_dead_process_is_not_stale(tmp_path, monkeypatch):
    from hyperpar import run_lock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    info = json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "since": "then"})
    (tmp_path / run_lock.LOCK_FILE).write_text(info)
    with run_lock.hold(tmp_path):  # flock: the kernel released the dead process's lock
        pass
    # Without flock (some network filesystems) the file itself is the lock: a dead owner's is taken over,
    # a live owner's is respected.
    import fcntl

    def no_flock(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / run_lock.LOCK_FILE).write_text(info)
    with run_lock.hold(tmp_path):
        assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / run_lock.LOCK_FILE).exists()
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))
    with pytest.raises(ConfigError, match=f"in use by another hyperpar run: pid {os.getppid()}"):
        run_lock.acquire(tmp_path)


def test_refused_resume_leaves_the_run_dir_untouched(base, tmp_path, capfd):
    run = copy_run(base, tmp_path / "run")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("written by the run that saved the checkpoints\n")

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}

    before = snapshot()
    rc, lines = run_entry("hyperpar", [*SMALL, f"train.steps={STEPS}", *CKPT, "checkpoint.resume=auto",
                                       "train.global_batch_size=3", f"hydra.run.dir={run}"], capfd)
    assert rc == 2 and len(lines) == 1 and "train.global_batch_size=3" in lines[0], lines
    after = snapshot()
    for files in (before, after):
        files.pop(".hyperpar.lock", None)  # the lock file itself (empty when no run holds it)
    assert after == before


# ---- how a run ends ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig,status,code", [("TERM", "preempted", 0), ("INT", "stopped", 130)])
def test_signal_saves_records_status_and_prints_the_resume_command(tmp_path, capfd, monkeypatch, sig, status, code):
    run = tmp_path / "run"
    monkeypatch.setenv("HYPERPAR_TEST_SIGNAL_AT_STEP", "2")
    monkeypatch.setenv("HYPERPAR_TEST_SIGNAL", sig)
    rc, lines = run_entry("hyperpar", [*SMALL, "train.steps=6", "checkpoint=default", "checkpoint.save_steps=0",
                                       "metrics.progress_bar=false", f"hydra.run.dir={run}"], capfd)
    text = "\n".join(lines)
    assert rc == code and "Traceback" not in text, text[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == status and result["step"] == 2
    assert d.is_complete(ckpt(run, 2))
    assert f"[hyperpar] {status} (" in text and "after step 2 of 6; checkpoint step_2 saved" in text, text[-2000:]
    assert f"[hyperpar] resume: python -m hyperpar" in text and f"checkpoint.resume=auto hydra.run.dir={run}" in text
    assert "done:" not in text


def test_second_ctrl_c_exits_at_once(tmp_path):
    code = ("import os, signal, time\n"
            "from hyperpar.checkpoint.preemption import PreemptionFlag\n"
            "flag = PreemptionFlag().install()\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
            "os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded again: ignored\n"
            "time.sleep(1.3); assert flag.requested\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30); print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and "second Ctrl-C: exiting now" in res.stderr and "not reached" not in res.stdout, res.stderr


def test_resume_command_drops_what_would_restart_elsewhere():
    from hyperpar.run_status import resume_command

    cmd = resume_command(["checkpoint=default", "checkpoint.load_path=/x/step_2", "train.stop_after_steps=3",
                          "hydra.run.dir=/old", "data.blend=0.3 /a 0.7 /b"], "/runs/a b")
    assert cmd == ("python -m hyperpar checkpoint=default 'data.blend=0.3 /a 0.7 /b' checkpoint.resume=auto "
                   "'hydra.run.dir=/runs/a b'")


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("HYPERPAR_TEST_DISK_FULL_AT_SAVE", "4")
    rc, lines = run_entry("hyperpar", [*SMALL, f"train.steps={STEPS}", *CKPT, "metrics.progress_bar=false",
                                       f"hydra.run.dir={run}"], capfd)
    text = "\n".join(lines)
    assert rc == 2 and "Traceback" not in text, text[-3000:]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("checkpoint error: disk full: saving checkpoint step_4"), text[-3000:]
    assert f"writing '{run / 'checkpoints' / 'step_4.tmp'}" in errors[0] and re.search(r"it needs about [0-9.]+ MB", errors[0]), errors[0]
    assert "4 KB is free" in errors[0] and "step_2 stays the resume point" in errors[0]
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [2] and not (run / "checkpoints" / "step_4.tmp").exists()
    d.verify_checkpoint(ckpt(run, 2))
    assert json.loads((run / "result.json").read_text())["status"] == "failed"


def test_converter_failure_leaves_no_temporary_files(tmp_path, capfd):
    from hyperpar.data.hf import resolve_path

    src = tmp_path / "docs.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    out = tmp_path / "out" / "corpus"
    rc, lines = run_entry("hyperpar.data.megatron.convert",
                          ["--input", str(src), "--tokenizer", resolve_path("pkg://hyperpar.data/corpus/tokenizer"),
                           "--output-prefix", str(out), "--quiet"], capfd)
    assert rc == 2 and len(lines) == 1 and f"{src}:2: not UTF-8 text" in lines[0], lines
    assert list(out.parent.iterdir()) == []
