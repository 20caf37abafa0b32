"""Shared test helpers: compose a job config like the CLI does, run a job in-process or the CLI in a
subprocess, read what a run wrote. The tiny configs themselves live in fixtures.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from fixtures import DETERMINISTIC, SMALL, STEPS

REPO = Path(__file__).resolve().parents[1]


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import hyperpar.cli  # noqa: F401  (registers schemas and resolvers)
    from hyperpar.config import validate_schema

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hyperpar.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides or [])
    GlobalHydra.instance().clear()
    return validate_schema(cfg)


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HYPERPAR_NO_BAR"] = "1"
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(args: list[str], *, cwd: Path, timeout: float = 600, module: str = "hyperpar") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def read_losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def run_small(run_dir: Path, overrides: list[str], *, steps: int = STEPS) -> dict[int, float]:
    """One tiny in-process job through the driver's run_job (preflight + worker), like the CLI does."""
    from hyperpar.launch import run_job

    cfg = compose_cfg(["metrics.progress_bar=false", *SMALL, f"train.steps={steps}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    run_job(cfg, str(run_dir))
    return read_losses(run_dir)


def cli_small(run_dir: Path, overrides: list[str], *, env: dict | None = None, timeout: float = 600,
              steps: int = STEPS) -> subprocess.CompletedProcess:
    """One tiny job through the real CLI in a subprocess, writing to ``run_dir``."""
    return subprocess.run([sys.executable, "-m", "hyperpar", *SMALL, f"train.steps={steps}", *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl deduplicated by step (the last record wins), deterministic fields only."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = {k: rec[k] for k in DETERMINISTIC}
    return out


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The CLI failed with exactly one non-empty stderr line and no traceback; returns that line."""
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return lines[0]


def hf_named_grads(model) -> dict:
    """The model's gradients under the checkpoint's key names (split parameters fused back), to
    compare with a transformers model's ``named_parameters()`` grads."""
    from hyperpar.models.fused import join_parts
    from hyperpar.models.spec import spec_of_model

    adapter = spec_of_model(model).adapter(model.args)
    return dict(join_parts(kv for n, p in model.named_parameters() for kv in adapter.export_param(n, p.grad).items()))
