"""Read the step profiles of a run (``profile.steps``), or compare two runs' profiles.

    python -m hyperpar.profile_report RUN_DIR                 # every profiled step and rank
    python -m hyperpar.profile_report RUN_A RUN_B [--top 12]  # B against A: phases and operators

One run: per profiled step, a row per rank (wall time, phases, FSDP and collective time, largest
operator), then the operators of the step averaged over its ranks. Two runs (e.g. ``single`` and
``fsdp2`` of the same model): the last profiled step of each, averaged over each run's ranks, phase
by phase and operator by operator, largest differences first: where B's extra time goes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from hyperpar.errors import HyperparError

_FIELDS = ("step_time_s", "fsdp_hooks_s", "collectives_s")
# inductor names each compiled graph by a hash that differs between runs and layouts: one bucket
_COMPILED = re.compile(r"^## Call CompiledFxGraph \S+ ##$")
COMPILED_GRAPHS = "compiled graphs (inductor, own time)"


class ProfileError(HyperparError):
    kind = "profile"


def _op_name(name: str) -> str:
    return COMPILED_GRAPHS if _COMPILED.match(name) else name


def load_profiles(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every ``profile/step_<N>/rank<r>.json`` of a run: step -> the ranks' summaries (rank order)."""
    root = Path(run_dir) / "profile"
    found: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(root.glob("step_*/rank*.json")):
        if path.name.endswith(".trace.json"):
            continue
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ProfileError(f"cannot read {path}: {e}", hint="a profile is written when its step ends; "
                                "was the run stopped while writing it?") from None
        found[int(d["step"])].append(d)
    if not found:
        raise ProfileError(f"no step profiles under {root}",
                            hint="profile a run with profile.steps=[N] (e.g. +experiment=profile_step)")
    return {s: sorted(v, key=lambda d: d["rank"]) for s, v in sorted(found.items())}


def mean_over_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's view of a step: times averaged over the ranks that profiled it; an operator a rank
    did not run counts as 0 s there."""
    n = len(ranks)
    phases: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for d in ranks:
        for k, v in d["phases_s"].items():
            phases[k] += v / n
        for o in d["top_ops"]:
            ops[_op_name(o["name"])] += o["self_s"] / n
            calls[_op_name(o["name"])] += o["count"] / n
    out = {k: sum((d.get(k) or 0.0) for d in ranks) / n for k in _FIELDS}
    return {**out, "phases_s": dict(phases), "ops_s": dict(ops), "calls": dict(calls), "ranks": n}


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def report_one(profiles: dict[int, list[dict[str, Any]]], top: int) -> str:
    lines = []
    for step, ranks in profiles.items():
        phases = sorted({k for d in ranks for k in d["phases_s"]})
        lines += [f"## step {step} ({len(ranks)} rank{'s' if len(ranks) > 1 else ''}; seconds, under the profiler)", "",
                  _row(["rank", "step", *phases, "FSDP hooks", "collectives", "largest operator (self)"]),
                  _row(["---"] * (len(phases) + 5))]
        for d in ranks:
            first = d["top_ops"][0] if d["top_ops"] else {"name": "-", "self_s": 0.0}
            lines.append(_row([str(d["rank"]), f"{d.get('step_time_s') or 0:.3f}",
                               *(f"{d['phases_s'].get(p, 0.0):.3f}" for p in phases),
                               f"{d.get('fsdp_hooks_s', 0.0):.3f}", f"{d.get('collectives_s', 0.0):.3f}",
                               f"{first['name']} {first['self_s']:.3f}"]))
        mean = mean_over_ranks(ranks)
        lines += ["", "operators, self seconds (mean over ranks):", "",
                  _row(["operator", "self s", "calls"]), _row(["---"] * 3)]
        for name, v in sorted(mean["ops_s"].items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
            lines.append(_row([name, f"{v:.3f}", f"{mean['calls'][name]:.0f}"]))
        lines.append("")
    return "\n".join(lines)


def report_two(a: dict[int, list[dict[str, Any]]], b: dict[int, list[dict[str, Any]]], names: tuple[str, str],
               top: int) -> str:
    sa, sb = max(a), max(b)
    ma, mb = mean_over_ranks(a[sa]), mean_over_ranks(b[sb])
    na, nb = names

    def line(label: str, x: float, y: float) -> str:
        ratio = f"{y / x:.3f}x" if x > 0 else "-"
        return _row([label, f"{x:.3f}", f"{y:.3f}", f"{y - x:+.3f}", ratio])

    head = [_row(["", f"A: {na}", f"B: {nb}", "B - A", "B / A"]), _row(["---"] * 5)]
    lines = [f"A = {na} (step {sa}, {ma['ranks']} ranks), B = {nb} (step {sb}, {mb['ranks']} ranks); seconds "
             "under the profiler, each run's ranks averaged", "", *head,
             line("step", ma["step_time_s"], mb["step_time_s"])]
    for k in sorted(set(ma["phases_s"]) | set(mb["phases_s"])):
        lines.append(line(k, ma["phases_s"].get(k, 0.0), mb["phases_s"].get(k, 0.0)))
    lines.append(line("FSDP hooks", ma["fsdp_hooks_s"], mb["fsdp_hooks_s"]))
    lines.append(line("collectives", ma["collectives_s"], mb["collectives_s"]))
    # An operator outside a run's listed top operators counts 0 s there (profile.row_limit bounds both).
    diffs = {k: mb["ops_s"].get(k, 0.0) - ma["ops_s"].get(k, 0.0) for k in set(ma["ops_s"]) | set(mb["ops_s"])}
    lines += ["", f"operators, self seconds, largest differences first (top {top}):", "", *head]
    for k, _ in sorted(diffs.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]:
        lines.append(line(k, ma["ops_s"].get(k, 0.0), mb["ops_s"].get(k, 0.0)))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperpar.profile_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run directory, or two to compare (A B)")
    parser.add_argument("--top", type=int, default=15, help="operators to list (default 15)")
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error("give one run directory, or two to compare")
    try:
        profiles = [load_profiles(r) for r in args.runs]
    except HyperparError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    if len(profiles) == 1:
        print(report_one(profiles[0], args.top))
    else:
        print(report_two(profiles[0], profiles[1], (args.runs[0], args.runs[1]), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
