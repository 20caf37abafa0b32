"""``profile.steps``: torch.profiler around chosen optimizer steps, its files, and that it changes nothing."""

from __future__ import annotations

import json

import pytest

from helpers import cli_small, compose_cfg, read_losses, run_small


def _profile_dir(run_dir, step: int):
    return run_dir / "profile" / f"step_{step:06d}"


def test_profiled_step_writes_table_summary_and_trace_and_keeps_the_loss(tmp_path, capsys) -> None:
    plain = run_small(tmp_path / "plain", [], steps=3)
    profiled = run_small(tmp_path / "prof", ["profile.steps=[2]", "profile.row_limit=12"], steps=3)
    assert profiled == plain  # the profiler observes; the step computes the same numbers

    assert sorted(p.name for p in (tmp_path / "prof" / "profile").iterdir()) == ["step_000002"]
    out = _profile_dir(tmp_path / "prof", 2)
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank0.trace.json", "rank0.txt"]
    summary = json.loads((out / "rank0.json").read_text())
    assert summary["step"] == 2 and summary["rank"] == 0
    # the trainer's phases nest inside the step: their sum cannot exceed its wall time
    assert set(summary["phases_s"]) == {"data", "forward_backward", "clip_grad", "optimizer"}
    assert 0 < sum(summary["phases_s"].values()) <= summary["step_time_s"]
    assert summary["phases_s"]["forward_backward"] > summary["phases_s"]["optimizer"]
    assert summary["fsdp_hooks_s"] == 0 and summary["collectives_s"] == 0  # one process: no distributed work
    ops = {o["name"]: o for o in summary["top_ops"]}
    assert len(summary["top_ops"]) == 12
    assert "aten::mm" in ops and ops["aten::mm"]["count"] > 0 and ops["aten::mm"]["self_s"] > 0
    assert not any(name.startswith("hyperpar/") for name in ops)
    assert "aten::mm" in (out / "rank0.txt").read_text()
    trace = json.loads((out / "rank0.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"hyperpar/forward_backward", "hyperpar/optimizer", "aten::mm"} <= names

    from hyperpar.profile_report import main

    assert main([str(tmp_path / "prof"), "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "## step 2 (1 rank;" in text and "| aten::mm |" in text
    assert main([str(tmp_path / "plain")]) == 2  # nothing profiled there: one line, exit 2
    assert "profile error: no step profiles under" in capsys.readouterr().err


def _summary(rank: int, step_s: float, fb: float, ops: dict[str, float], fsdp: float = 0.0) -> dict:
    return {"step": 4, "rank": rank, "device": "cpu", "step_time_s": step_s, "fsdp_hooks_s": fsdp,
            "collectives_s": fsdp / 2, "phases_s": {"forward_backward": fb, "optimizer": 0.05},
            "top_ops": [{"name": k, "count": 2, "self_s": v, "total_s": v} for k, v in ops.items()]}


def _write_run(root, summaries: list[dict]):
    for d in summaries:
        out = root / "profile" / f"step_{d['step']:06d}"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{d['rank']}.json").write_text(json.dumps(d))
    return root


def test_profile_report_compares_two_runs_per_phase_and_operator(tmp_path, capsys) -> None:
    from hyperpar.profile_report import COMPILED_GRAPHS, load_profiles, main, mean_over_ranks

    a = _write_run(tmp_path / "single", [_summary(0, 2.0, 1.9, {"aten::mm": 1.5, "## Call CompiledFxGraph fabc ##": 0.2})])
    b = _write_run(tmp_path / "fsdp2", [
        _summary(0, 2.4, 2.3, {"aten::mm": 1.4, "aten::copy_": 0.3, "## Call CompiledFxGraph fxyz ##": 0.1}, fsdp=0.4),
        _summary(1, 2.2, 2.1, {"aten::mm": 1.8, "## Call CompiledFxGraph fxyz ##": 0.3}, fsdp=0.2)])
    mean = mean_over_ranks(load_profiles(b)[4])
    assert mean["ranks"] == 2 and mean["step_time_s"] == pytest.approx(2.3)
    assert mean["fsdp_hooks_s"] == pytest.approx(0.3)
    assert mean["ops_s"]["aten::copy_"] == pytest.approx(0.15)  # rank 1 did not list it: 0 s there
    assert mean["ops_s"][COMPILED_GRAPHS] == pytest.approx(0.2)  # graphs of other hashes, one bucket

    assert main([str(a), str(b), "--top", "3"]) == 0
    text = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["step"].endswith("| 2.000 | 2.300 | +0.300 | 1.150x |")
    assert rows["FSDP hooks"].endswith("| 0.000 | 0.300 | +0.300 | - |")
    ops = [line.split(" | ")[0].strip("| ") for line in text.split("largest differences first")[1].splitlines()
           if line.startswith("| ") and "---" not in line][1:]
    assert ops == ["aten::copy_", "aten::mm", COMPILED_GRAPHS]  # +0.15, +0.1, 0: by the size of the change
    assert rows["aten::mm"].endswith("| 1.500 | 1.600 | +0.100 | 1.067x |")


def test_profile_settings_are_checked(tmp_path) -> None:
    from hyperpar.config import check_values
    from hyperpar.errors import ConfigError

    with pytest.raises(ConfigError, match="profile.steps"):
        check_values(compose_cfg(["profile.steps=[0]"]))
    with pytest.raises(ConfigError, match=r"profile.ranks=\[0, 2\]: the layout has ranks 0..1, not \[2\]"):
        check_values(compose_cfg(["parallel=fsdp2", "profile.ranks=[0,2]"]))
    check_values(compose_cfg(["parallel=fsdp2", "profile.ranks=[1]", "profile.steps=[3]"]))


def test_profile_step_after_the_run_warns(tmp_path) -> None:
    res = cli_small(tmp_path / "run", ["profile.steps=[9]", "profile.trace=false"], steps=2)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "profile.steps [9] lie after train.steps=2: not profiled" in res.stderr
    assert not (tmp_path / "run" / "profile").exists()
    assert sorted(read_losses(tmp_path / "run")) == [1, 2]


@pytest.mark.slow
def test_profile_ranks_choose_which_processes_write(tmp_path) -> None:
    res = cli_small(tmp_path / "run", ["parallel=fsdp2", "profile.steps=[1,2]", "profile.ranks=[1]",
                                       "profile.trace=false"], steps=2)
    assert res.returncode == 0, res.stderr[-2000:]
    for step in (1, 2):
        out = _profile_dir(tmp_path / "run", step)
        assert sorted(p.name for p in out.iterdir()) == ["rank1.json", "rank1.txt"]
        summary = json.loads((out / "rank1.json").read_text())
        assert summary["rank"] == 1
        # FSDP's hooks (gathers, reductions, their copies) and the collectives inside them, counted once
        assert summary["collectives_s"] > 0 and summary["fsdp_hooks_s"] > 0
        assert summary["fsdp_hooks_s"] < summary["step_time_s"]
