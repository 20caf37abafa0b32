"""Per-step metrics: metrics.jsonl (rank 0, every step, flushed so a crash loses nothing), a tqdm bar
or a log line every ``train.log_every`` steps, optional TensorBoard (every step), and per-rank log files."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from hyperpar.errors import ConfigError

log = logging.getLogger("hyperpar")


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line as its record, or None for a line that is not one (empty, or cut short by
    a crash): a record is a JSON object whose ``step`` is a whole number."""
    try:
        rec = json.loads(line)
        step = rec["step"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
        return None
    return rec


def retire_records_after(run_dir: str | Path, step: int) -> int:
    """Move the metrics.jsonl records of steps after ``step`` to metrics.abandoned.jsonl (a run that
    rewinds to ``step`` in its own dir: readers keep the last record per step, which would mix the
    left branch's later steps into the new one). Returns how many records moved."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, gone = [], []
    for line in path.read_text().splitlines():
        rec = parse_record(line)
        (gone if rec is not None and int(rec["step"]) > step else keep).append(line)
    if gone:
        with open(Path(run_dir) / "metrics.abandoned.jsonl", "a") as f:
            f.write("\n".join(gone) + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return len(gone)


def setup_rank_logging(run_dir: str | Path, rank: int, *, console: bool) -> None:
    """logs/rank_<r>.log for every rank; the console only for rank 0 (other ranks stay quiet)."""
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("hyperpar")
    root.setLevel(logging.INFO)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(logs / f"rank_{rank}.log", mode="a")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if console:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(logging.Formatter("[hyperpar] %(message)s"))
        root.addHandler(ch)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, rank: int, total_steps: int, start_step: int = 0,
                 progress_bar: bool = True, tensorboard: bool = False, log_every: int = 1) -> None:
        if log_every < 1:
            raise ConfigError(f"train.log_every={log_every} must be >= 1", hint="1 shows every step")
        self.rank = rank
        self.log_every = int(log_every)
        self.total_steps = total_steps
        self._unshown = 0  # steps written but not yet counted on the bar
        self.active = rank == 0
        self.run_dir = Path(run_dir)
        self._file = None
        self._bar = None
        self._tb = None
        if not self.active:
            return
        # Records past the step this run starts from belong to a trajectory it does not continue (a
        # fresh run in a used dir, a restart from an earlier checkpoint): readers would mix them in.
        moved = retire_records_after(self.run_dir, start_step)
        if moved:
            log.warning("metrics: %d records after step %d, from an earlier run in this dir, moved to "
                        "metrics.abandoned.jsonl", moved, start_step)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if progress_bar and os.environ.get("HYPERPAR_NO_BAR") != "1":  # the variable: log lines instead (CI, tests)
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, record["step"])
        self._unshown += 1
        step = record["step"]
        if step % self.log_every != 0 and step != self.total_steps:
            return
        if self._bar is not None:
            if "skipped" not in record:  # a skipped step has no loss to show
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self._bar.update(self._unshown)
        elif "skipped" in record:
            log.info("step %d skipped (%s)", step, record["skipped"])
        else:
            log.info("step %d loss %.6f grad_norm %.4f lr %.3g tok/s %.0f", record["step"], record["loss"],
                     record["grad_norm"], record["lr"], record["tokens_per_s"])
        self._unshown = 0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._unshown)  # a run that stopped early between two shown steps
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
