"""Step profiler: ``torch.profiler`` around the optimizer steps a user names (``profile.steps``).

For each profiled step every chosen rank writes, under ``<run_dir>/profile/step_<N>/``:

- ``rank<r>.txt``: the operator table (self time first), what to read first;
- ``rank<r>.json``: the step's phases (forward + backward, clipping, optimizer), its wall time, the
  host time in FSDP's hooks and in collectives, and the top operators, for scripts comparing two
  runs or two ranks;
- ``rank<r>.trace.json``: the Chrome trace (``profile.trace``), to open in https://ui.perfetto.dev.

The trainer marks its phases with :func:`phase` (``record_function`` ranges named ``hyperpar/...``);
they cost a few microseconds a step when no profiler runs. Nothing here changes what a step computes:
a profiled step's loss is the unprofiled one's (tested).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger("hyperpar")

PHASE_PREFIX = "hyperpar/"
PHASES = ("data", "forward_backward", "clip_grad", "optimizer")
# with_stack adds the Python frames ("trainer.py(104): train_step", "<built-in method ...>") to the
# averages; the operator ranking leaves them out (the trace keeps them)
_PY_FRAME = re.compile(r"^(<built-in .*>|.*\.py\(\d+\): .*)$")
# the host time a rank spends in distributed work: FSDP's hooks (its copies into and out of the
# collective buffers, the collectives, the waits inside them) and any collective call, each range
# counted once at its outermost level
_FSDP = re.compile(r"^FSDP::")
_COLLECTIVE = re.compile(r"^(c10d::|gloo:|nccl:|hccl:|record_param_comms)")


def _outermost_time(events: Any, pattern: re.Pattern) -> float:
    """Seconds of host time in ranges named by ``pattern`` that no other such range encloses."""
    total = 0.0
    for e in events:
        if not pattern.match(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not pattern.match(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            total += e.cpu_time_total
    return total / 1e6


def phase(name: str) -> contextlib.AbstractContextManager:
    """A named range of the step (one of :data:`PHASES`), shown in the trace and in ``rank<r>.json``."""
    return record_function(PHASE_PREFIX + name)


class StepProfiler:
    """Profiles the optimizer steps in ``steps`` (1-based, the numbers metrics.jsonl uses) on ``ranks``
    (None: every rank)."""

    def __init__(self, run_dir: str, rank: int, device_type: str, *, steps: Sequence[int],
                 ranks: Sequence[int] | None = None, record_shapes: bool = False, with_stack: bool = False,
                 memory: bool = False, trace: bool = True, row_limit: int = 30) -> None:
        self.dir = Path(run_dir) / "profile"
        self.rank = rank
        self.device_type = device_type
        self.steps = {int(s) for s in steps}
        self.active = ranks is None or rank in {int(r) for r in ranks}
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.memory = memory
        self.trace = trace
        self.row_limit = row_limit

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, rank: int, device_type: str) -> "StepProfiler | None":
        """None when ``cfg.steps`` is empty (profiling off)."""
        if cfg is None or not list(cfg.steps):
            return None
        return cls(run_dir, rank, device_type, steps=list(cfg.steps),
                   ranks=None if cfg.ranks is None else list(cfg.ranks), record_shapes=bool(cfg.record_shapes),
                   with_stack=bool(cfg.with_stack), memory=bool(cfg.memory), trace=bool(cfg.trace),
                   row_limit=int(cfg.row_limit))

    def wants(self, step: int) -> bool:
        return self.active and step in self.steps

    def _activities(self) -> list[ProfilerActivity]:
        acts = [ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        # NPU: torch_npu's own profiler (torch_npu.profiler) sees the device; here only the host side.
        return acts

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[dict[str, Any]]:
        """Profile the body if ``step`` is chosen; the caller puts the step's metrics record (its
        ``step_time_s``) into the yielded dict, which the summary reads."""
        box: dict[str, Any] = {}
        if not self.wants(step):
            yield box
            return
        with profile(activities=self._activities(), record_shapes=self.record_shapes,
                     profile_memory=self.memory, with_stack=self.with_stack) as prof:
            yield box
        try:
            self._write(prof, step, box.get("record") or {})
        except Exception as e:  # noqa: BLE001 - an observer's failure must not end the training run
            # (seen: torch 2.13 with with_stack=true now and then fails to decode an event's name)
            log.warning("profile of step %d on rank %d not written: %s: %s", step, self.rank, type(e).__name__, e)

    def _write(self, prof: profile, step: int, record: dict[str, Any]) -> None:
        out = self.dir / f"step_{step:06d}"
        out.mkdir(parents=True, exist_ok=True)
        on_device = ProfilerActivity.CUDA in self._activities()
        self_key = "self_device_time_total" if on_device else "self_cpu_time_total"
        # with record_shapes the table and the ranking split each operator by its input shapes
        averages = prof.key_averages(group_by_input_shape=self.record_shapes)
        table = averages.table(sort_by=self_key, row_limit=self.row_limit)
        (out / f"rank{self.rank}.txt").write_text(table + "\n")
        names = {PHASE_PREFIX + p: p for p in PHASES}
        events = prof.events()
        phases = {names[e.key]: e.cpu_time_total / 1e6 for e in averages if e.key in names}
        ops = sorted((e for e in averages if e.key not in names and not _PY_FRAME.match(e.key)),
                     key=lambda e: getattr(e, self_key), reverse=True)[: self.row_limit]
        summary = {
            "step": step, "rank": self.rank, "device": self.device_type,
            "step_time_s": record.get("step_time_s"),  # with the profiler's own overhead
            "phases_s": phases,
            # host seconds (on CUDA the collectives' launches; on CPU their whole run, waits included)
            "fsdp_hooks_s": _outermost_time(events, _FSDP),
            "collectives_s": _outermost_time(events, _COLLECTIVE),
            "top_ops": [{"name": e.key, "count": e.count, "self_s": getattr(e, self_key) / 1e6,
                         "total_s": (e.device_time_total if on_device else e.cpu_time_total) / 1e6,
                         **({"input_shapes": e.input_shapes} if self.record_shapes else {})}
                        for e in ops],
        }
        (out / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=1) + "\n")
        if self.trace:
            prof.export_chrome_trace(str(out / f"rank{self.rank}.trace.json"))
        top = ", ".join(f"{o['name']} {o['self_s']:.3f}s" for o in summary["top_ops"][:4])
        spent = ", ".join([f"{k} {v:.3f}s" for k, v in phases.items()]
                          + [f"{k[:-2]} {summary[k]:.3f}s" for k in ("fsdp_hooks_s", "collectives_s") if summary[k]])
        log.info("profiled step %d on rank %d -> %s (%s; top ops: %s)", step, self.rank, out, spent, top)
