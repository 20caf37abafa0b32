"""Hydra callback: write the parity report when a multirun sweep ends and set the exit code.

Registered by conf/experiment/parity.yaml under `hydra.callbacks`. It reads the job dirs from
disk rather than keeping anything in memory, because with other launchers (joblib, submitit)
the jobs run in other processes and on_job_end never reaches the driver's instance.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hyperpar.parity.compare import DEFAULT_TOLERANCE_MEAN, StepTolerance
from hyperpar.parity.report import build_report, console_summary
from hyperpar.parity.runs import ParityInputError, job_dirs

# Exit code when the report itself could not be built: distinct from 1 (jobs failed/diverged).
EXIT_BAD_INPUT = 2


def _job_started(job_dir: Path) -> float:
    """When a job of this dir last started: Hydra writes .hydra/ at every job's start."""
    for marker in (job_dir / ".hydra" / "overrides.yaml", job_dir / "result.json", job_dir / "metrics.jsonl"):
        if marker.exists():
            return marker.stat().st_mtime
    return job_dir.stat().st_mtime


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "") in ("", "0")


def step_tolerance(value: Any) -> StepTolerance:
    """The callback's tolerance_step setting: null/"auto" → auto, false/"none"/"off" → off."""
    if value is None or value == "auto":
        return "auto"
    if value is False or (isinstance(value, str) and value.lower() in ("none", "off")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ParityInputError(
        f"parity tolerance_step must be a number, null, 'auto' or 'off', not {value!r}"
    )


def check_attached(parity_cfg: DictConfig, callbacks: Any) -> None:
    """parity.* settings act only through this callback, which ``+experiment=parity`` registers: a
    setting changed without it would do nothing, so it is a ConfigError."""
    import dataclasses

    from hyperpar.config import ParityConfig
    from hyperpar.errors import ConfigError

    targets = [str(OmegaConf.select(c, "_target_", default="")) for c in (callbacks or {}).values()]
    if any(t.endswith(".ParityCallback") for t in targets):
        return
    for f in dataclasses.fields(ParityConfig):
        value = parity_cfg.get(f.name, f.default)
        if value != f.default:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"parity.{f.name}={shown} has no effect without the parity report callback",
                              hint="add +experiment=parity, which registers it: python -m hyperpar -m "
                                   "parallel=single,fsdp2 +experiment=parity")


class ParityCallback(Callback):
    """Compare the sweep's jobs with the 1-process job; SystemExit(1) when parity fails.

    A setting left null here falls back to `parity.<name>` in the composed config, so the
    callback also works when registered without the interpolations.
    """

    def __init__(
        self,
        tolerance_mean: float | None = None,
        tolerance_step: float | str | None = None,
        baseline: str | None = None,
    ) -> None:
        self.tolerance_mean = tolerance_mean
        self.tolerance_step = tolerance_step
        self.baseline = baseline
        # job dir -> when it last started, as the sweep began: one still so at its end is an earlier sweep's
        self._before: dict[str, float] | None = None

    def _setting(self, config: DictConfig, name: str) -> Any:
        value = getattr(self, name)
        if value is None:
            value = OmegaConf.select(config, f"parity.{name}", default=None)
        return value

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # File times against file times (no clock of this host): on a shared filesystem the jobs'
        # writers may run on other nodes.
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir", default=None)
        self._before = {p.name: _job_started(p) for p in job_dirs(Path(sweep_dir))} if sweep_dir else {}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # `parity.enabled=false` lets a user rerun the experiment's sweep without the verdict.
        if not _is_rank_zero() or OmegaConf.select(config, "parity.enabled", default=True) is False:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            tolerance_mean = self._setting(config, "tolerance_mean")
            if tolerance_mean is None:
                tolerance_mean = DEFAULT_TOLERANCE_MEAN
            runs = job_dirs(sweep_dir)
            if self._before is not None:
                stale = [p for p in runs if self._before.get(p.name) == _job_started(p)]
                if stale:
                    print(f"parity: left out {len(stale)} job dir(s) an earlier sweep left in {sweep_dir} "
                          f"({', '.join(p.name for p in stale)})", file=sys.stderr, flush=True)
                    runs = [p for p in runs if p not in stale]
            if not runs:
                raise ParityInputError(f"no job dirs found in sweep dir {sweep_dir}")
            result = build_report(
                runs,
                sweep_dir,
                baseline=self._setting(config, "baseline"),
                tolerance_mean=tolerance_mean,
                tolerance_step=step_tolerance(self._setting(config, "tolerance_step")),
            )
        except ParityInputError as e:
            print(e.one_line(), file=sys.stderr, flush=True)
            raise SystemExit(EXIT_BAD_INPUT) from None
        except Exception:
            # Hydra downgrades a callback's exception to a warning and exits 0, which would let
            # a sweep whose report crashed look like a pass. Keep the traceback (it is our bug)
            # but make the exit code say the sweep proved nothing.
            traceback.print_exc()
            raise SystemExit(EXIT_BAD_INPUT) from None

        print(console_summary(result), flush=True)
        print(f"parity report: {result.outputs['md']} (+ .json, .png)", flush=True)
        print(result.summary, flush=True)
        if not result.passed:
            raise SystemExit(1)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # A job that raised makes Hydra skip on_multirun_end (no report at all), so say so
        # while the user can still see which job it was and how to get the report anyway.
        if not _is_rank_zero() or job_return.status != JobStatus.FAILED:
            return
        if OmegaConf.select(config, "hydra.mode", default=None) != RunMode.MULTIRUN:
            return
        error = getattr(job_return, "_return_value", None)
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir", default="<sweep dir>")
        print(
            f"parity: job {job_return.overrides} raised {type(error).__name__}: {error}; Hydra will "
            f"skip the parity report, run `python -m hyperpar.parity {sweep_dir}` after the sweep",
            file=sys.stderr,
            flush=True,
        )

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if _is_rank_zero():
            print(
                "parity: a single run has nothing to compare with; run the experiment as a "
                "multirun, e.g. `python -m hyperpar -m parallel=single,ddp2 +experiment=parity`",
                file=sys.stderr,
                flush=True,
            )
