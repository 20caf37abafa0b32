"""Write the parity report (parity.md, parity.json, parity.png) and build it end to end."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hyperpar.parity.compare import (
    AUX_KEYS,
    BF16_GROSS_STEP,
    DEFAULT_TOLERANCE_MEAN,
    GRAD_NORM_RTOL,
    JobRow,
    ParityResult,
    StepTolerance,
    compare_runs,
)
from hyperpar.parity.runs import read_runs

# log-scale axes cannot draw 0: bitwise-equal runs sit on this floor instead of vanishing.
_DIFF_FLOOR = 1e-12
_ERROR_CHARS = 400


def build_report(
    run_dirs: list[Path],
    out_dir: Path,
    *,
    baseline: str | None = None,
    tolerance_mean: float = DEFAULT_TOLERANCE_MEAN,
    tolerance_step: StepTolerance = "auto",
) -> ParityResult:
    """Compare the run dirs and write parity.{md,json,png} into out_dir.

    tolerance_step: a number bounds every step; "auto" uses 1e-5, and for bf16 jobs (whose contract
    is the mean) only a gross bound; None turns the per-step check off.
    """
    records = read_runs([Path(p) for p in run_dirs])
    result = compare_runs(
        records, baseline=baseline, tolerance_mean=tolerance_mean, tolerance_step=tolerance_step
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result.outputs = {
        "md": write_markdown(result, out_dir / "parity.md"),
        "json": write_json(result, out_dir / "parity.json"),
        "png": write_png(result, out_dir / "parity.png"),
    }
    return result


# ---- markdown -----------------------------------------------------------------------------


def _cell(text: object) -> str:
    # A "|" inside a cell would split it into two columns.
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _one_line(text: str | None) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= _ERROR_CHARS else line[: _ERROR_CHARS - 1] + "…"


def _step_cell(row: JobRow) -> str:
    if row.is_baseline or row.max_step_diff is None:
        return "—"
    text = f"{row.max_step_diff:.3e} @ {row.max_step_diff_step}"
    return text if row.step_check == "checked" else f"{text}, {row.step_check}"


def tolerance_lines(result: ParityResult) -> list[str]:
    mode = result.tolerance_step_mode
    if mode == "off":
        step = "off (not checked)"
    elif mode == "auto":
        step = (f"{result.tolerance_step:.1e} for fp32 jobs; {BF16_GROSS_STEP:.0e} for bf16 jobs (gross errors only: "
                "their contract is the mean)")
    else:
        step = f"{result.tolerance_step:.1e} (set explicitly, all jobs)"
    return [
        f"- mean loss over compared steps: |Δmean| ≤ {result.tolerance_mean:.1e}",
        f"- per step: max |Δstep| ≤ {step}",
        f"- where the fp32 per-step check runs: {' and '.join(AUX_KEYS)} within the same bound, grad_norm within "
        f"{GRAD_NORM_RTOL:.0e} relative",
        "- every job logs the baseline's steps (and skips the same ones); each layout is compared with the "
        "1-process job of its own experiment (the same overrides apart from parallel/launch/hydra)",
        *(["- MoE: an fp32 job whose routes part from the baseline's at a near-tied token is held per step up to "
           "there, then by the mean and the bf16 bound"] if any(r.route_split for r in result.rows) else []),
    ]


def console_summary(result: ParityResult) -> str:
    """What a sweep prints: the table, the tolerances in force, why each failed job failed."""
    lines = [markdown_table(result), "tolerances:", *tolerance_lines(result)]
    for r in result.failed_rows:
        lines.append(f"FAIL {r.label}: {_one_line('; '.join(r.reasons))}")
    for r in result.rows:
        if r.passed and r.route_split:
            lines.append(f"note {r.label}: {r.route_split}")
    return "\n".join(lines)


def markdown_table(result: ParityResult) -> str:
    # The literal "|Δmean|" would split the header's cells too; escape it like any other cell.
    header = (
        "| job | parallel | world size | dtype | steps compared | mean loss | \\|Δmean\\| "
        "| max \\|Δstep\\| @ step | verdict |"
    )
    lines = [header, "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in result.rows:
        steps = f"{r.steps_compared}/{r.baseline_steps}"
        cells = [
            r.label,
            r.parallel or "?",
            "?" if r.world_size is None else r.world_size,
            r.param_dtype or "?",
            steps,
            _num(r.mean_loss, ".6f"),
            "—" if r.is_baseline else _num(r.mean_diff, ".3e"),
            _step_cell(r),
            f"**{r.verdict}**" if not r.passed else r.verdict,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render_markdown(result: ParityResult) -> str:
    base = result.baseline
    lines = [
        "# Parity report",
        "",
        f"Baseline: `{base}` (job dir `{result.baseline_name}`). Every other job's loss is "
        "compared with its baseline's at every step.",
        "",
        "Tolerances:",
        *tolerance_lines(result),
        "",
        markdown_table(result),
        "",
    ]
    failed = result.failed_rows
    if failed:
        lines.append("Failures:")
        lines.extend(f"- `{r.label}`: {_one_line('; '.join(r.reasons))}" for r in failed)
        lines.append("")
    notes = [r for r in result.rows if r.passed and r.route_split]
    if notes:
        lines.append("MoE routes (see docs/guide/parity.md, \"MoE: near-tied routes\"):")
        lines.extend(f"- `{r.label}`: {r.route_split}" for r in notes)
        lines.append("")
    lines.append(result.summary)
    return "\n".join(lines) + "\n"


def write_markdown(result: ParityResult, path: Path) -> Path:
    path.write_text(render_markdown(result), encoding="utf-8")
    return path


# ---- json ---------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity; a non-finite number becomes null (reasons say why).
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def to_dict(result: ParityResult) -> dict[str, Any]:
    rows = []
    for r in result.rows:
        row = asdict(r)
        row.update(passed=r.passed, verdict=r.verdict)
        rows.append(row)
    return _finite(
        {
            "passed": result.passed,
            "summary": result.summary,
            "baseline": result.baseline,
            "baseline_name": result.baseline_name,
            "tolerance_mean": result.tolerance_mean,
            "tolerance_step": result.tolerance_step,
            "tolerance_step_mode": result.tolerance_step_mode,
            "jobs": rows,
        }
    )


def write_json(result: ParityResult, path: Path) -> Path:
    path.write_text(json.dumps(to_dict(result), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


# ---- png ----------------------------------------------------------------------------------


def _plottable(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]


def write_png(result: ParityResult, path: Path) -> Path:
    """Top: every job's loss over the baseline's; bottom: per-step |Δloss| on a log axis."""
    # Figure + Agg canvas directly, not pyplot: no global backend switch, no display needed,
    # and matplotlib's import cost is paid only when a report is written.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(result.rows))]

    for row, color in zip(result.rows, colors):
        if row.is_baseline or not row.steps:
            continue
        top.plot(row.steps, _plottable(row.losses), color=color, lw=1.2, label=row.label)
        bad = next((s for s, v in zip(row.steps, row.losses) if not math.isfinite(v)), None)
        if bad is not None:  # NaN/inf leave only a gap in a curve: mark where it starts
            top.axvline(bad, color=color, ls="-.", lw=1, label=f"{row.label}: non-finite")
        if row.compared_steps:
            diffs = [max(d, _DIFF_FLOOR) if math.isfinite(d) else math.nan for d in row.step_diffs]
            bottom.plot(row.compared_steps, diffs, color=color, lw=1.2, marker=".", ms=3,
                        label=row.label)
        if row.route_split_step is not None:  # MoE: from here the routes (and so the losses) may part
            bottom.axvline(row.route_split_step, color=color, ls="--", lw=1, label=f"{row.label}: routes part")
    base = next(r for r in result.rows if r.is_baseline)
    if base.steps:
        # Drawn last and dashed so the jobs that match it bitwise stay visible underneath.
        top.plot(base.steps, _plottable(base.losses), color="black", lw=2.4, ls="--",
                 label=f"{base.label} (baseline)", zorder=5)

    bounds = {r.tolerance_step for r in result.rows
              if r.tolerance_step is not None and not r.is_baseline}
    for bound in sorted(bounds):
        bottom.axhline(bound, color="red", ls=":", lw=1.2, label=f"tolerance {bound:.0e}")

    verdict = "PASS" if result.passed else "FAIL"
    top.set_title(f"Parity vs {result.baseline}: {verdict}")
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    bottom.set_yscale("log")
    if not bottom.lines:
        bottom.set_ylim(_DIFF_FLOOR, 1.0)  # nothing to compare: keep a valid log axis anyway
    bottom.set_ylabel(f"|loss − baseline|  ({_DIFF_FLOOR:.0e} = equal)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(alpha=0.3, which="both")
    for ax in (top, bottom):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=110)
    return path
