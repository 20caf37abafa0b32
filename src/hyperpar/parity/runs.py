"""Read the run dirs a sweep left behind (metrics.jsonl, result.json, .hydra/overrides.yaml).

Everything here reads files only: the report must work offline, after the fact, on a sweep
whose jobs crashed, and from a driver that never held any job's state in memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hyperpar.errors import HyperparError
from hyperpar.train.metrics import parse_record

# Any of these marks a directory as a job's run dir. A job that crashed before its first step
# has no metrics.jsonl, and one that crashed hard has no result.json either, yet it must still
# appear in the report as FAIL rather than silently vanish from it.
_RUN_MARKERS = ("metrics.jsonl", "result.json", ".hydra")


class ParityInputError(HyperparError):
    """The report cannot be built from what it was given (no run dirs, unknown baseline...)."""

    kind = "parity"


@dataclass
class RunRecord:
    """One job of a sweep, as its run dir describes it."""

    path: Path
    name: str  # the dir name, e.g. "0"; unique within one report
    status: str  # "completed" | "failed"
    error: str | None
    parallel: str | None
    world_size: int | None
    param_dtype: str | None
    overrides: list[str] = field(default_factory=list)
    job_name: str | None = None
    # step -> that step's metrics record (last occurrence wins), in step order
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    skipped_lines: int = 0  # unparseable metrics lines (e.g. a line cut short by a crash)
    label: str = ""  # filled by label_runs: what tells this job apart from the others
    # from result.json: the step the run ended at, and what it was asked for (None: not recorded)
    final_step: int | None = None
    planned_steps: int | None = None
    seed: int | None = None
    model: str | None = None

    @property
    def losses(self) -> dict[int, float]:
        # A skipped step (its global batch had no labelled token) has no loss to compare.
        return {step: as_float(rec.get("loss")) for step, rec in self.metrics.items() if "skipped" not in rec}

    @property
    def skipped_steps(self) -> set[int]:
        return {step for step, rec in self.metrics.items() if "skipped" in rec}

    @property
    def failed(self) -> bool:
        return self.status != "completed"


def as_float(value: Any) -> float:
    # A missing or null loss counts as NaN so the non-finite check catches it.
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_metrics(path: Path) -> tuple[dict[int, dict[str, Any]], int]:
    """Per-step records from a metrics.jsonl, deduplicated by step keeping the last occurrence.

    A resumed run re-logs the steps after its checkpoint; the later lines are the ones that
    belong to the final trajectory. Returns (records by step, number of unparseable lines).
    """
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    if not path.is_file():
        return by_step, skipped
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = parse_record(line)
            if rec is None:
                skipped += 1
                continue
            step = int(rec["step"])
            by_step.pop(step, None)  # re-insert so a repeated step takes its new value
            by_step[step] = rec
    return dict(sorted(by_step.items())), skipped


def _read_overrides_yaml(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def _parallel_from_overrides(overrides: list[str]) -> str | None:
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if sep and key == "parallel":
            return value
    return None


def read_run(run_dir: Path) -> RunRecord:
    """Read one job's run dir; a missing or unreadable result.json makes the job failed."""
    run_dir = Path(run_dir)
    metrics, skipped = read_metrics(run_dir / "metrics.jsonl")
    result: dict[str, Any] = {}
    error: str | None = None
    result_path = run_dir / "result.json"
    if not result_path.is_file():
        error = "no result.json"
    else:
        try:
            loaded = json.loads(result_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
            result = loaded
        except ValueError as e:
            error = f"unreadable result.json: {e}"

    overrides = [str(o) for o in result.get("overrides") or []] or _read_overrides_yaml(run_dir)
    status = str(result.get("status") or "failed") if error is None else "failed"
    if error is None and status != "completed":
        error = result.get("error") or f"status {status!r}"
    world_size = result.get("world_size")
    return RunRecord(
        path=run_dir,
        name=run_dir.name,
        status=status,
        error=None if error is None else str(error),
        parallel=result.get("parallel") or _parallel_from_overrides(overrides),
        world_size=int(world_size) if isinstance(world_size, (int, float)) else None,
        param_dtype=result.get("param_dtype"),
        overrides=overrides,
        job_name=result.get("job_name"),
        metrics=metrics,
        skipped_lines=skipped,
        final_step=_as_int(result.get("step")),
        planned_steps=_as_int(result.get("steps")),
        seed=_as_int(result.get("seed")),
        model=str(result["model"]) if result.get("model") is not None else None,
    )


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in _RUN_MARKERS)


def _job_sort_key(path: Path) -> tuple[int, int, str]:
    # Hydra names job dirs by job number; "10" must come after "9", not after "1".
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job subdirs of a sweep dir, in job-number order (hidden dirs are Hydra's or ours)."""
    if not sweep_dir.is_dir():
        return []
    subdirs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted((p for p in subdirs if is_run_dir(p)), key=_job_sort_key)


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Expand the paths a user gave into run dirs: a run dir is itself, a sweep dir its jobs."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ParityInputError(f"{path} is not a directory")
        if (path / "metrics.jsonl").is_file() or (path / "result.json").is_file():
            found.append(path)
            continue
        jobs = job_dirs(path)
        if jobs:
            found.extend(jobs)
        elif is_run_dir(path):  # e.g. a job that crashed before writing anything but .hydra/
            found.append(path)
    if not found:
        shown = ", ".join(str(p) for p in paths) or "(none)"
        raise ParityInputError(
            f"no run dirs found in {shown}",
            hint="pass a sweep dir (multirun/<date>/<time>) or job dirs holding metrics.jsonl",
        )
    return found


def read_runs(run_dirs: list[Path]) -> list[RunRecord]:
    """Read every run dir and give each a unique name and a human label."""
    records = [read_run(p) for p in run_dirs]
    _unique_names(records)
    label_runs(records)
    return records


def _unique_names(records: list[RunRecord]) -> None:
    # Two sweeps compared together both have a job "0": fall back to parent/name for those.
    counts: dict[str, int] = {}
    for r in records:
        counts[r.name] = counts.get(r.name, 0) + 1
    for r in records:
        if counts[r.name] > 1:
            r.name = f"{r.path.parent.name}/{r.path.name}"


def label_runs(records: list[RunRecord]) -> None:
    """Label each job by the overrides that differ across the sweep (e.g. "parallel=fsdp2").

    Overrides every job shares (+experiment=parity) say nothing about which job is which.
    """
    task = [[o for o in r.overrides if not o.lstrip("+~").startswith("hydra.")] for r in records]
    shared = set.intersection(*(set(t) for t in task)) if len(task) > 1 else set()
    for r, overrides in zip(records, task):
        varying = [o for o in overrides if o not in shared]
        r.label = ",".join(varying) or r.parallel or r.name
    seen: dict[str, int] = {}
    for r in records:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in records:
        if seen[r.label] > 1:
            r.label = f"{r.name}:{r.label}"
