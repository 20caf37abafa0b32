"""Parity report from synthetic run dirs: no training, no processes except the CLI checks."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hyperpar.parity import build_report, compare_runs, find_run_dirs, read_runs
from hyperpar.parity.callback import ParityCallback, step_tolerance

SRC = Path(__file__).resolve().parents[1] / "src"
LOSSES = [2.5, 2.25, 2.0, 1.875, 1.75]


def make_run(
    root: Path,
    num: int,
    parallel: str,
    losses: list[float] = LOSSES,
    *,
    world_size: int = 2,
    dtype: str = "float32",
    status: str = "completed",
    error: str | None = None,
    write_result: bool = True,
    steps: list[int] | None = None,
    extra: list[str] = (),
    metrics: dict[int, dict] | None = None,
) -> Path:
    """A job dir as the trainer leaves it inside a sweep dir (``metrics``: per-step fields to add or,
    as None, drop)."""
    run = root / str(num)
    (run / ".hydra").mkdir(parents=True)
    overrides = [f"parallel={parallel}", "+experiment=parity", *extra]
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    steps = steps or list(range(1, len(losses) + 1))
    with (run / "metrics.jsonl").open("w") as f:
        for step, loss in zip(steps, losses):
            rec = {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64,
                   "tokens_per_s": 1000.0, "step_time_s": 0.064, "peak_mem_mb": 10.0, "mfu": 0.0}
            rec.update((metrics or {}).get(step, {}))
            rec = {k: v for k, v in rec.items() if v is not None}
            f.write(json.dumps(rec) + "\n")
    if write_result:
        result = {"status": status, "error": error, "job_name": "hyperpar", "overrides": overrides,
                  "parallel": parallel, "world_size": 1 if parallel == "single" else world_size,
                  "param_dtype": dtype, "steps": len(LOSSES), "seed": 0}
        (run / "result.json").write_text(json.dumps(result))
    return run


def with_offset(step: int, delta: float) -> list[float]:
    return [v + delta if i + 1 == step else v for i, v in enumerate(LOSSES)]


def compare(sweep: Path, **kwargs):
    return compare_runs(read_runs(find_run_dirs([sweep])), **kwargs)


def row(result, parallel: str):
    return next(r for r in result.rows if r.parallel == parallel)


def test_equal_runs_pass_and_write_all_files(tmp_path: Path) -> None:
    for i, p in enumerate(["single", "ddp2", "fsdp2"]):
        make_run(tmp_path, i, p)
    result = build_report(find_run_dirs([tmp_path]), tmp_path)

    assert result.passed
    assert [r.verdict for r in result.rows] == ["baseline", "PASS", "PASS"]
    assert row(result, "fsdp2").max_step_diff == 0.0
    md = (tmp_path / "parity.md").read_text()
    assert "| parallel=fsdp2 | fsdp2 | 2 | float32 | 5/5 |" in md
    assert md.rstrip().endswith("PASS: all 3 jobs within tolerance")
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["passed"] is True and data["baseline"] == "parallel=single"
    assert data["jobs"][1]["losses"] == LOSSES and data["jobs"][1]["steps"] == [1, 2, 3, 4, 5]
    png = tmp_path / "parity.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_one_step_off_fails_per_step_check_but_not_mean(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "fsdp2", with_offset(3, 2e-5))
    result = compare(tmp_path)

    fsdp = row(result, "fsdp2")
    assert not result.passed and fsdp.verdict == "FAIL"
    assert fsdp.mean_diff == pytest.approx(4e-6) and fsdp.mean_diff <= result.tolerance_mean
    assert fsdp.max_step_diff == pytest.approx(2e-5) and fsdp.max_step_diff_step == 3
    assert len(fsdp.reasons) == 1 and "step 3" in fsdp.reasons[0]
    # The same run passes once the user turns the per-step check off.
    assert compare(tmp_path, tolerance_step=None).passed


def test_bf16_skips_per_step_check_unless_set_explicitly(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single", dtype="bfloat16")
    make_run(tmp_path, 1, "fsdp2", with_offset(3, 2e-3), dtype="bfloat16")
    result = build_report(find_run_dirs([tmp_path]), tmp_path)

    assert result.passed
    assert row(result, "fsdp2").step_check == "bf16: gross only"
    assert "bf16: gross only" in (tmp_path / "parity.md").read_text()
    assert not compare(tmp_path, tolerance_step=1e-5).passed
    # The bf16 contract still bounds the mean.
    make_run(tmp_path, 2, "ddp2", [v + 1e-2 for v in LOSSES], dtype="bfloat16")
    assert row(compare(tmp_path), "ddp2").verdict == "FAIL"
    # ... and per step, gross errors that would cancel in the mean
    make_run(tmp_path, 3, "tp2", [v + d for v, d in zip(LOSSES, (0.3, -0.3, 0, 0, 0))], dtype="bfloat16")
    tp2 = row(compare(tmp_path), "tp2")
    assert tp2.mean_diff < 1e-6 and tp2.verdict == "FAIL" and tp2.reasons[0].startswith("max |Δstep| 3.000e-01 at step")


def test_failed_job_fails_report_and_shows_its_error(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "fsdp2", LOSSES[:2], status="failed",
             error="RuntimeError: CUDA out of memory | rank 1")
    result = build_report(find_run_dirs([tmp_path]), tmp_path)

    assert not result.passed
    assert row(result, "fsdp2").steps_compared == 2
    md = (tmp_path / "parity.md").read_text()
    assert "job failed: RuntimeError: CUDA out of memory | rank 1" in md
    assert md.rstrip().endswith("FAIL: 1 of 2 jobs failed or outside tolerance (parallel=fsdp2)")
    job = json.loads((tmp_path / "parity.json").read_text())["jobs"][1]
    assert job["status"] == "failed" and job["verdict"] == "FAIL" and "out of memory" in job["error"]


def test_missing_result_json_is_a_failed_job_labelled_from_overrides(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "hsdp2x2", write_result=False)
    result = compare(tmp_path)

    hsdp = next(r for r in result.rows if r.name == "1")
    assert hsdp.label == "parallel=hsdp2x2" and hsdp.parallel == "hsdp2x2"
    assert hsdp.status == "failed" and hsdp.error == "no result.json" and not result.passed


def test_resumed_run_keeps_last_occurrence_of_each_step(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single")
    # Steps 3-4 logged twice: the first attempt diverged, the resumed attempt is the real one.
    make_run(tmp_path, 1, "ddp2", [2.5, 2.25, 9.0, 9.0, 2.0, 1.875, 1.75], steps=[1, 2, 3, 4, 3, 4, 5])
    result = compare(tmp_path)

    ddp = row(result, "ddp2")
    assert ddp.steps == [1, 2, 3, 4, 5] and ddp.losses == LOSSES
    assert result.passed


def test_non_finite_loss_fails_and_json_stays_strict(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "ddp2", with_offset(2, math.nan))
    result = build_report(find_run_dirs([tmp_path]), tmp_path)

    assert not result.passed and "non-finite loss (nan) at step 2" in row(result, "ddp2").reasons
    data = json.loads((tmp_path / "parity.json").read_text(), parse_constant=pytest.fail)
    assert data["jobs"][1]["losses"][1] is None


def test_baseline_defaults_to_single_process_job_and_can_be_named(tmp_path: Path) -> None:
    make_run(tmp_path, 0, "fsdp2")
    make_run(tmp_path, 1, "single", with_offset(1, 1.0))
    assert compare(tmp_path).baseline == "parallel=single"
    named = compare(tmp_path, baseline="fsdp2")
    assert named.baseline_name == "0" and row(named, "single").verdict == "FAIL"


def test_a_multi_process_job_named_single_is_not_the_baseline(tmp_path: Path) -> None:
    """The baseline is the job that ran one process, by its recorded world size, not by its name."""
    fake = make_run(tmp_path, 0, "single", with_offset(2, 1.0))
    result = json.loads((fake / "result.json").read_text())
    (fake / "result.json").write_text(json.dumps({**result, "world_size": 2}))
    make_run(tmp_path, 1, "fsdp2")
    make_run(tmp_path, 2, "single")
    got = compare(tmp_path)
    assert got.baseline_name == "2", got.baseline_name


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "hyperpar.parity", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_exit_codes(tmp_path: Path) -> None:
    good, bad, empty = tmp_path / "good", tmp_path / "bad", tmp_path / "empty"
    make_run(good, 0, "single")
    make_run(good, 1, "ddp2")
    make_run(bad, 0, "single")
    make_run(bad, 1, "ddp2", with_offset(2, 2e-5))
    empty.mkdir()

    ok = run_cli(str(good), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "PASS: all 2 jobs within tolerance" in ok.stdout and (good / "parity.md").is_file()

    # Explicit run dirs: the report goes to --out (else the current dir).
    fail = run_cli(str(bad / "0"), str(bad / "1"), "--out", str(tmp_path / "rep"), cwd=tmp_path)
    assert fail.returncode == 1 and "FAIL: 1 of 2" in fail.stdout
    assert (tmp_path / "rep" / "parity.json").is_file()
    assert run_cli(str(bad), "--tolerance-step", "none", cwd=tmp_path).returncode == 0

    missing = run_cli(str(empty), cwd=tmp_path)
    assert missing.returncode == 2 and "no run dirs found" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def sweep_config(sweep: Path, **parity) -> object:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "parity": parity})


def test_callback_writes_report_and_exits_1_on_failure(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "fsdp2", with_offset(4, 2e-5))
    cfg = sweep_config(tmp_path, tolerance_mean=5e-3, tolerance_step=None, baseline=None)

    with pytest.raises(SystemExit) as exc:
        ParityCallback(tolerance_mean=5e-3, tolerance_step=None, baseline=None).on_multirun_end(cfg)
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert str(tmp_path / "parity.md") in out and "FAIL: 1 of 2" in out
    assert (tmp_path / "parity.png").stat().st_size > 0

    # Settings left null on the callback fall back to the config's parity node.
    ParityCallback().on_multirun_end(sweep_config(tmp_path, tolerance_step="off"))
    ParityCallback().on_multirun_end(sweep_config(tmp_path, enabled=False))  # report turned off
    monkeypatch.setenv("RANK", "1")
    ParityCallback().on_multirun_end(cfg)  # not rank 0: no report, no exit


def test_callback_exits_2_when_the_sweep_dir_has_no_jobs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        ParityCallback().on_multirun_end(sweep_config(tmp_path))
    assert exc.value.code == 2


def test_step_tolerance_setting() -> None:
    assert step_tolerance(None) == "auto" and step_tolerance("auto") == "auto"
    assert step_tolerance("off") is None and step_tolerance(False) is None
    assert step_tolerance(1e-4) == 1e-4 and step_tolerance("2e-5") == 2e-5


def test_tolerance_step_settings_compose() -> None:
    """parity.md's `parity.tolerance_step=off` composes (the schema typed it float and refused it), and the
    value reaches the callback as the setting it names."""
    from helpers import compose_cfg

    from hyperpar.config import check_values
    from hyperpar.errors import ConfigError

    for value, setting in (("off", None), ("1e-4", 1e-4), ("null", "auto"), ("auto", "auto")):
        cfg = check_values(compose_cfg(["+experiment=parity", f"parity.tolerance_step={value}"]), warn=False)
        assert step_tolerance(cfg.parity.tolerance_step) == setting
    for bad in ("abc", "-1", "true"):
        with pytest.raises(ConfigError, match="parity.tolerance_step"):
            check_values(compose_cfg(["+experiment=parity", f"parity.tolerance_step={bad}"]), warn=False)


# ---- what a report must not pass --------------------------------------------------------------------


def test_a_job_missing_steps_or_skipping_others_fails(tmp_path: Path) -> None:
    """Parity is over the whole run: a job that logged fewer steps (a metrics file cut short, mixed
    runs), skipped other steps or left an unreadable line proves nothing about the rest."""
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "ddp2", LOSSES[:3])
    make_run(tmp_path, 2, "fsdp2", metrics={2: {"skipped": 1, "loss": None}})
    run = make_run(tmp_path, 3, "hsdp2x2")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "loss": 1.6')  # cut short by a crash
    result = compare(tmp_path)
    assert "logged steps differ from the baseline's: missing steps 4, 5" in row(result, "ddp2").reasons
    assert "skipped steps 2 against the baseline's none" in row(result, "fsdp2").reasons
    assert "1 unreadable metrics line(s)" in row(result, "hsdp2x2").reasons


def test_grad_norm_and_the_aux_and_mtp_losses_are_compared_per_step(tmp_path: Path) -> None:
    mtp = {s: {"mtp_loss": 3.0, "aux_loss": 0.01} for s in range(1, 6)}
    make_run(tmp_path, 0, "single", metrics=mtp)
    make_run(tmp_path, 1, "ddp2", metrics={**mtp, 4: {"mtp_loss": 3.1, "aux_loss": 0.01}})
    make_run(tmp_path, 2, "fsdp2", metrics={**mtp, 2: {"mtp_loss": 3.0, "aux_loss": 0.01, "grad_norm": 1.01}})
    make_run(tmp_path, 3, "hsdp2x2")  # no MTP at all: another objective
    make_run(tmp_path, 4, "tp2", metrics={**mtp, 3: {"mtp_loss": 3.0, "aux_loss": 0.01, "grad_norm": 1.00005}})
    result = compare(tmp_path)
    assert any(r.startswith("mtp_loss: max |Δstep| 1.000e-01 at step 4") for r in row(result, "ddp2").reasons)
    assert any(r.startswith("grad_norm: max relative |Δstep| 1.000e-02 at step 2") for r in row(result, "fsdp2").reasons)
    assert "aux_loss logged by the baseline only" in row(result, "hsdp2x2").reasons
    assert row(result, "tp2").passed  # 5e-5 relative: within fp32's reduction-order rounding


def test_each_layout_is_compared_with_the_one_process_job_of_its_own_setting(tmp_path: Path) -> None:
    """A second sweep axis (here the seed) makes groups: every layout against its own `single`."""
    other = [v + 0.5 for v in LOSSES]
    make_run(tmp_path, 0, "single", extra=["train.seed=1"])
    make_run(tmp_path, 1, "single", other, extra=["train.seed=2"])
    make_run(tmp_path, 2, "ddp2", extra=["train.seed=1"])
    make_run(tmp_path, 3, "ddp2", other, extra=["train.seed=2"])
    result = compare(tmp_path)
    assert result.passed and [r.baseline for r in result.rows] == ["parallel=single,train.seed=1",
                                                                   "parallel=single,train.seed=2"] * 2
    # a group without a 1-process job, or a sweep of one job, proves nothing: bad input, not a pass
    from hyperpar.parity.runs import ParityInputError

    make_run(tmp_path, 4, "fsdp2", extra=["train.seed=3"])
    with pytest.raises(ParityInputError, match="no 1-process job trains the same experiment as"):
        compare(tmp_path)
    assert compare(tmp_path, baseline="0").rows[4].baseline == "parallel=single,train.seed=1"  # named: the user's call
    lone = tmp_path / "lone"
    make_run(lone, 0, "single")
    with pytest.raises(ParityInputError, match="nothing to compare"):
        compare(lone)


def test_the_callback_leaves_out_job_dirs_of_an_earlier_sweep(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    make_run(tmp_path, 0, "single", with_offset(2, 1.0))  # an earlier sweep's jobs 0 and 2
    make_run(tmp_path, 2, "fsdp2", with_offset(2, 1.0))
    callback = ParityCallback()
    callback.on_multirun_start(sweep_config(tmp_path))
    shutil.rmtree(tmp_path / "0")  # this sweep's jobs 0 and 1 (Hydra rewrites a reused job dir)
    make_run(tmp_path, 0, "single")
    make_run(tmp_path, 1, "ddp2")
    os.utime(tmp_path / "0" / ".hydra" / "overrides.yaml", (1e9, 1e9))  # file times, not this host's clock
    callback.on_multirun_end(sweep_config(tmp_path))  # passes: the stale job 2 is not this sweep's
    assert "left out 1 job dir(s) an earlier sweep left" in capsys.readouterr().err


def test_a_fresh_run_in_a_used_dir_moves_the_old_records_aside(tmp_path: Path) -> None:
    from hyperpar.train.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    MetricsWriter(tmp_path, rank=0, total_steps=2, start_step=1, progress_bar=False).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert len((tmp_path / "metrics.abandoned.jsonl").read_text().splitlines()) == 2


def routes(counts_by_step: dict[int, list[int]], margin: float = 1e-7, blocks: int = 2) -> dict[int, dict]:
    """MoE route fields per step: block 0 gets the given counts, the later blocks fixed ones."""
    out = {}
    for s, first in counts_by_step.items():
        counts = {f"model.layers.{b}.mlp": first if b == 0 else [4, 4, 4, 4] for b in range(blocks)}
        out[s] = {"route_hash": json.dumps(counts, sort_keys=True), "route_margin": margin, "route_counts": counts}
    return out


def test_moe_routes_parting_at_a_near_tie_are_held_per_step_only_before_it(tmp_path: Path) -> None:
    """A token whose top-k margin is within rounding goes to another expert under another layout: its
    job is held per step up to there and by the mean and the gross bound from there; routes that
    part by many tokens, or whose counts were not logged, leave the loss check failing, with why."""
    same = {s: [4, 4, 4, 4] for s in range(1, 6)}
    moved = {**same, 3: [5, 3, 4, 4], 4: [3, 5, 4, 4], 5: [4, 4, 5, 3]}  # one token moved at step 3
    make_run(tmp_path, 0, "single", metrics=routes(same))
    make_run(tmp_path, 1, "cp2", with_offset(3, 2e-4), metrics=routes(moved))
    make_run(tmp_path, 2, "ep2", with_offset(3, 2e-4), metrics=routes({**same, 3: [7, 1, 4, 4]}))
    no_counts = {s: {**r, "route_counts": None} for s, r in routes(moved).items()}
    make_run(tmp_path, 3, "tp2", with_offset(3, 2e-4), metrics=no_counts)
    make_run(tmp_path, 4, "fsdp2", with_offset(2, 2e-4), metrics=routes(moved))  # off before the routes part
    make_run(tmp_path, 5, "ddp2", with_offset(3, 2e-4), metrics=routes(moved, margin=1e-3))  # no tie there
    make_run(tmp_path, 6, "hsdp2x2", with_offset(3, 5e-2), metrics=routes(moved))  # grossly off after it
    result = compare(tmp_path)

    cp2 = row(result, "cp2")
    assert cp2.passed, cp2.reasons
    assert cp2.step_check.startswith("checked to step 2") and "near-tie" in cp2.step_check
    assert "1 assignment(s) in model.layers.0.mlp" in cp2.route_split and "(a near-tie)" in cp2.route_split
    ep2 = row(result, "ep2")
    assert not ep2.passed and "3 assignment(s) in model.layers.0.mlp" in ep2.reasons[-1]
    assert "(not a near-tie)" in ep2.reasons[-1]
    tp2 = row(result, "tp2")
    assert not tp2.passed and "metrics.route_counts=true" in tp2.reasons[-1]
    assert not row(result, "fsdp2").passed  # step 2 is held per step: the routes were still alike
    assert not row(result, "ddp2").passed  # one token moved, but no margin near a tie
    assert any("at step 3 > 2.0e-02" in r for r in row(result, "hsdp2x2").reasons)

    out = tmp_path / "report"
    out.mkdir()
    build_report(find_run_dirs([tmp_path]), out)
    md = (out / "parity.md").read_text()
    assert "MoE routes" in md and "`parallel=cp2`: routes first differ at step 3" in md
    assert "- MoE: an fp32 job whose routes part" in md
    job = json.loads((out / "parity.json").read_text())["jobs"][1]
    assert job["route_split"] == cp2.route_split and job["route_split_step"] == 3
    assert (out / "parity.png").stat().st_size > 0


def test_moe_routes_that_stay_alike_change_nothing(tmp_path: Path) -> None:
    same = routes({s: [4, 4, 4, 4] for s in range(1, 6)})
    make_run(tmp_path, 0, "single", metrics=same)
    make_run(tmp_path, 1, "ep2", with_offset(4, 2e-5), metrics=same)
    result = compare(tmp_path)
    ep2 = row(result, "ep2")
    assert not ep2.passed and ep2.route_split is None
    assert ep2.reasons == ["max |Δstep| 2.000e-05 at step 4 > 1.0e-05"]
