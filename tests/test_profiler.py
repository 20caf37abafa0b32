"""``profile.steps``: torch.profiler around chosen optimizer steps, its files, and that it changes nothing."""

from __future__ import annotations

import json

import pytest

from helpers import cli_small, compose_cfg, read_losses, run_small


def _profile_dir(run_dir, step: int):
    return run_dir / "profile" / f"step_{step:06d}"


def test_profiled_step_writes_table_summary_and_trace_and_keeps_the_loss(tmp_path) -> None:
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
