"""Shared test helpers: compose a job config like the CLI does, run the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

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
