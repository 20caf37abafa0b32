"""`python -m hyperpar.parity DIR [DIR ...]`: build the parity report offline.

Useful after a sweep whose job raised (Hydra then skips the callback), or to compare runs
from different sweeps. Exit code: 0 passed, 1 failed or diverged, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hyperpar.parity.compare import DEFAULT_TOLERANCE_MEAN, StepTolerance
from hyperpar.parity.report import build_report, console_summary
from hyperpar.parity.runs import ParityInputError, find_run_dirs


def _step_tolerance(text: str) -> StepTolerance:
    if text.lower() in ("none", "off"):
        return None
    if text.lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'none' or 'auto', not {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyperpar.parity",
        description="Compare run dirs (or the jobs of one sweep dir) with a baseline and write "
        "parity.md, parity.json and parity.png.",
    )
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a sweep dir or run dirs")
    p.add_argument("--baseline", default=None,
                   help="job label, dir name or parallel name (default: the 1-process job)")
    p.add_argument("--tolerance-mean", type=float, default=DEFAULT_TOLERANCE_MEAN,
                   help="bound on |mean loss - baseline mean loss| (default: %(default)g)")
    p.add_argument("--tolerance-step", type=_step_tolerance, default="auto",
                   help="bound on per-step |loss - baseline loss|; 'none' turns the check off "
                   "(default: auto = 1e-5, 2e-2 for bf16 jobs)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the report (default: the sweep dir, else the current dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        run_dirs = find_run_dirs(args.dirs)
        out = args.out
        if out is None:
            # One sweep dir given (it expanded into its jobs): the report lives beside them.
            single = args.dirs[0]
            out = single if len(args.dirs) == 1 and run_dirs != [single] else Path.cwd()
        result = build_report(
            run_dirs, out, baseline=args.baseline,
            tolerance_mean=args.tolerance_mean, tolerance_step=args.tolerance_step,
        )
    except ParityInputError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(console_summary(result))
    print()
    print(f"report: {result.outputs['md']}")
    print(result.summary)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
