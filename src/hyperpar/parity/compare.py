"""Compare every job's loss curve with the baseline's and give each a verdict.

The contract (docs/guide/parity.md, DESIGN.md "Numerics contract"): fp32 runs must match the
1-process run per step within 1e-5; bf16 runs only promise the mean loss over the compared
steps within 5e-3 (and no step grossly off), because bf16 rounding differs with the reduction
order of each layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hyperpar.parity.runs import ParityInputError, RunRecord, as_float

DEFAULT_TOLERANCE_MEAN = 5e-3
DEFAULT_TOLERANCE_STEP = 1e-5
# grad_norm (before clipping) is checked per step where the loss is, relative to the baseline's: it
# sums the squares of every gradient, reduced in another order by each layout (measured ~1e-6
# relative in fp32); a missing or doubled gradient shard moves it by percents.
GRAD_NORM_RTOL = 1e-4
# bf16 jobs in "auto" mode: per step only gross differences fail (measured bf16 spreads to `single`:
# 1e-4..3e-4 dense, up to 1.2e-3 MoE), so opposite errors cannot cancel in the mean.
BF16_GROSS_STEP = 2e-2
AUX_KEYS = ("aux_loss", "mtp_loss")  # compared like the loss, per step
# MoE (docs/guide/parity.md "MoE: near-tied routes"): top-k routing is discontinuous, so a token whose
# k-th and (k+1)-th router probabilities tie within rounding can go to another expert under another
# layout, and the losses then part by ~1e-4. An fp32 job is held per step up to the step where its
# routes first differ from the baseline's, and like a bf16 job from there, when that is a near-tie:
# in the first block (forward order) whose counts differ, at most ROUTE_TIE_TOKENS assignments moved,
# at a step where a top-k margin below ROUTE_TIE_MARGIN was seen. A layout that routes wrongly moves
# many tokens in that block.
ROUTE_TIE_TOKENS = 2
ROUTE_TIE_MARGIN = 1e-5
# Overrides that choose the layout, not the experiment: jobs differing only in these share a baseline.
_LAYOUT_KEYS = ("parallel", "launch", "hydra")
BF16 = "bfloat16"

StepTolerance = float | None | Literal["auto"]


@dataclass
class JobRow:
    """One job's comparison with the baseline; the fields are the report's columns."""

    name: str
    label: str
    baseline: str  # the label of the job this one is compared with
    path: str
    parallel: str | None
    world_size: int | None
    param_dtype: str | None
    status: str
    error: str | None
    is_baseline: bool
    steps: list[int]  # every logged step of this job (deduplicated)
    losses: list[float]  # loss at each of `steps`
    steps_compared: int  # steps this job shares with the baseline
    baseline_steps: int
    mean_loss: float | None  # over the compared steps
    baseline_mean_loss: float | None  # the baseline's mean over the same steps
    mean_diff: float | None  # |mean_loss - baseline_mean_loss|
    max_step_diff: float | None
    max_step_diff_step: int | None
    step_diffs: list[float]  # |loss - baseline loss| per compared step
    compared_steps: list[int]
    tolerance_step: float | None  # the per-step bound applied to this job; None = not checked
    step_check: str  # "checked", "bf16: gross only" or "off"
    tokens_per_s_mean: float | None
    peak_mem_mb_max: float | None
    reasons: list[str] = field(default_factory=list)  # why it failed; empty when it passed
    route_split: str | None = None  # MoE: where and how the routes first differ from the baseline's
    route_split_step: int | None = None

    @property
    def passed(self) -> bool:
        return not self.reasons

    @property
    def verdict(self) -> str:
        if self.is_baseline:
            return "baseline" if self.passed else "FAIL (baseline)"
        return "PASS" if self.passed else "FAIL"


@dataclass
class ParityResult:
    """The whole comparison; `passed` decides the sweep's exit code."""

    baseline: str  # the baseline job's label
    baseline_name: str
    tolerance_mean: float
    tolerance_step: float | None  # the fp32 per-step bound; None when the check is off
    tolerance_step_mode: str  # "auto" (a gross bound for bf16 jobs), "explicit" or "off"
    rows: list[JobRow]
    outputs: dict[str, Path] = field(default_factory=dict)  # "md"/"json"/"png" -> written file

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def failed_rows(self) -> list[JobRow]:
        return [r for r in self.rows if not r.passed]

    @property
    def summary(self) -> str:
        n = len(self.rows)
        if self.passed:
            return f"PASS: all {n} jobs within tolerance"
        k = len(self.failed_rows)
        names = ", ".join(r.label for r in self.failed_rows)
        return f"FAIL: {k} of {n} jobs failed or outside tolerance ({names})"


def _experiment_key(r: RunRecord) -> tuple[str, ...]:
    """What a job trains, apart from its layout: the overrides that are not layout keys (result.json's
    seed, model and steps are checked against the baseline's in each row, where both are known)."""
    def layout(o: str) -> bool:
        key = o.lstrip("+~").partition("=")[0]
        return any(key == k or key.startswith(k + ".") for k in _LAYOUT_KEYS)

    return tuple(sorted(o for o in r.overrides if not layout(o)))


def _is_one_process(r: RunRecord) -> bool:
    # the world size where the run recorded it: a job named after a packaged layout may have changed its degrees
    return r.world_size == 1 if r.world_size is not None else r.parallel == "single"


def baselines(records: list[RunRecord], baseline: str | None) -> dict[int, RunRecord]:
    """For every record (by index), the record it is compared with: the named job for all, else the
    1-process job training the same experiment (the same overrides apart from the layout). A sweep
    over a second axis (dtype, seed, ...) thus compares each layout with the 1-process job of its
    own setting."""
    if len(records) < 2:
        raise ParityInputError(f"{len(records)} job: nothing to compare",
                               hint="sweep a 1-process job and the layouts to check, e.g. -m parallel=single,fsdp2")
    if baseline is not None:
        base = select_baseline(records, baseline)
        return {i: base for i in range(len(records))}
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(_experiment_key(r), []).append(i)
    out: dict[int, RunRecord] = {}
    for members in groups.values():
        single = [records[i] for i in members if _is_one_process(records[i])]
        if not single:
            labels = ", ".join(records[i].label for i in members)
            raise ParityInputError(f"no 1-process job trains the same experiment as {labels}",
                                   hint="add parallel=single to the sweep (with the same other overrides), "
                                        "or name a job with parity.baseline / --baseline")
        for i in members:
            out[i] = single[0]
    return out


def select_baseline(records: list[RunRecord], baseline: str) -> RunRecord:
    """The job a user named: a dir name, a label, a parallel name or one of its overrides."""
    for attr in ("name", "label"):
        hits = [r for r in records if getattr(r, attr) == baseline]
        if len(hits) == 1:
            return hits[0]
    # Let a user say "single" or "parallel=single" instead of the exact label.
    hits = [r for r in records if r.parallel == baseline or baseline in r.overrides]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(f"{r.name} ({r.label})" for r in records)
    what = "matches more than one job" if hits else "matches no job"
    raise ParityInputError(f"baseline {baseline!r} {what}", hint=f"jobs: {known}")


def resolve_step_tolerance(tolerance_step: StepTolerance) -> tuple[float | None, str]:
    """(fp32 per-step bound, mode) from the user's setting."""
    if isinstance(tolerance_step, str):
        if tolerance_step != "auto":
            raise ParityInputError(
                f"tolerance_step must be a number, None or 'auto', not {tolerance_step!r}"
            )
        return DEFAULT_TOLERANCE_STEP, "auto"
    if tolerance_step is None:
        return None, "off"
    _check_tolerance("tolerance_step", tolerance_step)
    return float(tolerance_step), "explicit"


def _check_tolerance(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ParityInputError(f"{name} must be a finite number >= 0, not {value!r}")


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _metric(record: RunRecord, key: str, reduce: str) -> float | None:
    values = [v for rec in record.metrics.values() if isinstance(v := rec.get(key), (int, float))]
    if not values:
        return None
    return float(max(values) if reduce == "max" else _mean(values))


def compare_runs(
    records: list[RunRecord],
    *,
    baseline: str | None = None,
    tolerance_mean: float = DEFAULT_TOLERANCE_MEAN,
    tolerance_step: StepTolerance = "auto",
) -> ParityResult:
    """Compare every record with the baseline record."""
    if not records:
        raise ParityInputError("no runs to compare")
    _check_tolerance("tolerance_mean", tolerance_mean)
    step_bound, mode = resolve_step_tolerance(tolerance_step)
    bases = baselines(records, baseline)
    rows = [
        _compare_one(r, bases[i], bases[i].losses, float(tolerance_mean), step_bound, mode)
        for i, r in enumerate(records)
    ]
    chosen = list({id(b): b for b in bases.values()}.values())  # each baseline once, in job order
    return ParityResult(
        baseline=", ".join(b.label for b in chosen),
        baseline_name=", ".join(b.name for b in chosen),
        tolerance_mean=float(tolerance_mean),
        tolerance_step=step_bound,
        tolerance_step_mode=mode,
        rows=rows,
    )


@dataclass
class RouteSplit:
    """The first step at which a job's MoE routes differ from its baseline's (``route_hash``)."""

    step: int
    block: str | None = None  # the first block, in forward order, whose counts differ (None: unknown)
    moved: int | None = None  # assignments that differ in that block (a token that changed expert: 1)
    # the larger of the two runs' route_margin at that step: a near-tied token is near its tie in both
    margin: float | None = None

    @property
    def near_tie(self) -> bool:
        return (self.moved is not None and self.moved <= ROUTE_TIE_TOKENS
                and self.margin is not None and self.margin < ROUTE_TIE_MARGIN)

    def describe(self) -> str:
        margin = "" if self.margin is None else f", top-k margins down to {self.margin:.1e} in both runs"
        if self.block is None:
            return (f"routes first differ at step {self.step}{margin}; log metrics.route_counts=true to tell a "
                    "near-tied token from a routing error")
        what = "a near-tie" if self.near_tie else "not a near-tie"
        return f"routes first differ at step {self.step}: {self.moved} assignment(s) in {self.block}{margin} ({what})"


def route_split(run: dict[int, dict], base: dict[int, dict], steps: list[int]) -> RouteSplit | None:
    """Where ``run``'s routes first differ from ``base``'s over ``steps`` (metrics records by step);
    None if they never do or either run did not log them."""
    for s in steps:
        mine, theirs = run[s].get("route_hash"), base[s].get("route_hash")
        if mine is None or theirs is None:
            return None
        if mine == theirs:
            continue
        margins = [run[s].get("route_margin"), base[s].get("route_margin")]
        split = RouteSplit(s, margin=max(margins) if all(isinstance(m, (int, float)) for m in margins) else None)
        a, b = run[s].get("route_counts"), base[s].get("route_counts")
        if isinstance(a, dict) and isinstance(b, dict):
            for key, counts in a.items():  # logged in forward order
                other = b.get(key)
                if other != counts:
                    split.block = key
                    split.moved = (sum(abs(x - y) for x, y in zip(counts, other)) // 2 if isinstance(other, list)
                                   and len(other) == len(counts) else None)
                    break
        return split
    return None


def _compare_one(
    run: RunRecord,
    base: RunRecord,
    base_losses: dict[int, float],
    tol_mean: float,
    step_bound: float | None,
    mode: str,
) -> JobRow:
    losses = run.losses
    is_baseline = run is base
    common = [s for s in losses if s in base_losses]
    reasons: list[str] = []
    if run.failed:
        reasons.append(f"job failed: {run.error}")

    bf16 = BF16 in (run.param_dtype, base.param_dtype)
    if mode == "auto" and bf16:  # the mean is the contract; the loose bound catches errors that cancel in it
        row_bound, step_check = BF16_GROSS_STEP, "bf16: gross only"
    elif step_bound is None:
        row_bound, step_check = None, "off"
    else:
        row_bound, step_check = step_bound, "checked"

    bad = next((s for s, v in losses.items() if not math.isfinite(v)), None)
    if bad is not None:
        reasons.append(f"non-finite loss ({losses[bad]}) at step {bad}")

    mean_loss = base_mean = mean_diff = max_diff = None
    max_step: int | None = None
    diffs: list[float] = []
    if common:
        mean_loss = _mean([losses[s] for s in common])
        base_mean = _mean([base_losses[s] for s in common])
        mean_diff = abs(mean_loss - base_mean)
        diffs = [abs(losses[s] - base_losses[s]) for s in common]
        max_diff, max_step = _worst(diffs, common)

    split = None
    strict = common  # the steps held to the per-step bound
    if not is_baseline and common and step_check == "checked":
        split = route_split(run.metrics, base.metrics, common)
        if split is not None and split.near_tie:
            strict = [s for s in common if s < split.step]
            step_check = f"checked to step {split.step - 1}, then {BF16_GROSS_STEP:.0e} (routing near-tie)"
    if not is_baseline:
        if not common:
            reasons.append("no steps in common with the baseline")
        else:
            # `not (x <= tol)` so that a NaN difference fails instead of slipping through.
            if not (mean_diff <= tol_mean):
                reasons.append(f"|Δmean| {mean_diff:.3e} > {tol_mean:.1e}")
            for steps, bound in ((strict, row_bound), (common[len(strict):], BF16_GROSS_STEP)):  # strict: a prefix
                if steps and bound is not None:
                    d, at = _worst([abs(losses[s] - base_losses[s]) for s in steps], steps)
                    if not (d <= bound):
                        reasons.append(f"max |Δstep| {d:.3e} at step {at} > {bound:.1e}")
    elif not losses and not run.failed:
        reasons.append("the baseline logged no steps")
    reasons += _completeness(run, base, is_baseline)
    if not is_baseline and strict and step_check.startswith("checked"):
        reasons += _other_metrics(run, base, strict, row_bound)
    if split is not None and reasons and not split.near_tie:
        reasons.append(split.describe())

    return JobRow(
        name=run.name,
        label=run.label,
        baseline=base.label,
        path=str(run.path),
        parallel=run.parallel,
        world_size=run.world_size,
        param_dtype=run.param_dtype,
        status=run.status,
        error=run.error,
        is_baseline=is_baseline,
        steps=list(losses),
        losses=list(losses.values()),
        steps_compared=len(common),
        baseline_steps=len(base_losses),
        mean_loss=mean_loss,
        baseline_mean_loss=base_mean,
        mean_diff=mean_diff,
        max_step_diff=max_diff,
        max_step_diff_step=max_step,
        step_diffs=diffs,
        compared_steps=common,
        tolerance_step=row_bound,
        step_check=step_check,
        tokens_per_s_mean=_metric(run, "tokens_per_s", "mean"),
        peak_mem_mb_max=_metric(run, "peak_mem_mb", "max"),
        reasons=reasons,
        route_split=None if split is None else split.describe(),
        route_split_step=None if split is None else split.step,
    )


def _worst(diffs: list[float], steps: list[int]) -> tuple[float, int]:
    # NaN never compares greater, so pick the worst step by hand: a NaN diff is the worst.
    i = max(range(len(diffs)), key=lambda j: math.inf if math.isnan(diffs[j]) else diffs[j])
    return diffs[i], steps[i]


def _steps_text(steps: set[int]) -> str:
    shown = sorted(steps)
    return ", ".join(map(str, shown[:5])) + (f" (+{len(shown) - 5} more)" if len(shown) > 5 else "")


def _completeness(run: RunRecord, base: RunRecord, is_baseline: bool) -> list[str]:
    """A job proves parity only over the whole run: every step the baseline logged (a job that
    stopped early, a metrics file cut short or mixed with another run's records does not)."""
    reasons: list[str] = []
    if run.skipped_lines:
        reasons.append(f"{run.skipped_lines} unreadable metrics line(s)")
    if (not run.failed and run.final_step is not None and run.planned_steps is not None
            and run.final_step != run.planned_steps):
        reasons.append(f"ended at step {run.final_step} of {run.planned_steps}")
    if is_baseline or run.failed:
        return reasons
    mine, theirs = set(run.metrics), set(base.metrics)
    if mine != theirs:
        parts = [f"missing steps {_steps_text(theirs - mine)}" if theirs - mine else "",
                 f"extra steps {_steps_text(mine - theirs)}" if mine - theirs else ""]
        reasons.append("logged steps differ from the baseline's: " + "; ".join(p for p in parts if p))
    if run.skipped_steps != base.skipped_steps:
        reasons.append(f"skipped steps {_steps_text(run.skipped_steps) or 'none'} against the baseline's "
                       f"{_steps_text(base.skipped_steps) or 'none'}")
    for what, mine_v, theirs_v in (("seed", run.seed, base.seed), ("model", run.model, base.model),
                                   ("train.steps", run.planned_steps, base.planned_steps)):
        if mine_v is not None and theirs_v is not None and mine_v != theirs_v:
            reasons.append(f"not comparable: {what} {mine_v} against the baseline's {theirs_v}")
    return reasons


def _other_metrics(run: RunRecord, base: RunRecord, common: list[int], bound: float) -> list[str]:
    """The aux and MTP losses per step within the loss's bound; grad_norm within GRAD_NORM_RTOL of
    the baseline's. A key one run logs and the other does not is a different objective."""
    reasons: list[str] = []
    for key in (*AUX_KEYS, "grad_norm"):
        mine = [run.metrics[s].get(key) for s in common]
        theirs = [base.metrics[s].get(key) for s in common]
        have, want = any(v is not None for v in mine), any(v is not None for v in theirs)
        if have != want:
            reasons.append(f"{key} logged by {'this job' if have else 'the baseline'} only")
            continue
        if not have:
            continue
        worst, at = -1.0, None
        for s, a, b in zip(common, mine, theirs):
            d = abs(as_float(a) - as_float(b))
            if key == "grad_norm":
                d /= max(abs(as_float(b)), 1e-12)
            if math.isnan(d) or d > worst:
                worst, at = (math.inf if math.isnan(d) else d), s
        limit = GRAD_NORM_RTOL if key == "grad_norm" else bound
        if not (worst <= limit):
            kind = "relative " if key == "grad_norm" else ""
            reasons.append(f"{key}: max {kind}|Δstep| {worst:.3e} at step {at} > {limit:.1e}")
    return reasons
