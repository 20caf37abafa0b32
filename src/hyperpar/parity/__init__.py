"""Parity: prove that an N-process run trains like the 1-process run.

A multirun sweep leaves one run dir per job; this package compares their loss curves with a
baseline job and writes parity.{md,json,png} into the sweep dir. Entry points: `build_report`
(library), `python -m hyperpar.parity` (offline CLI) and `callback.ParityCallback` (Hydra).
"""

from hyperpar.parity.compare import JobRow, ParityResult, compare_runs
from hyperpar.parity.report import build_report
from hyperpar.parity.runs import ParityInputError, RunRecord, find_run_dirs, read_runs

__all__ = [
    "JobRow",
    "ParityInputError",
    "ParityResult",
    "RunRecord",
    "build_report",
    "compare_runs",
    "find_run_dirs",
    "read_runs",
]
