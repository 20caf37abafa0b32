"""How a run ended, as ``result.json`` records it and the driver reports it, with the resume command.

| status | when | exit |
|---|---|---|
| completed | the loop reached ``train.steps`` | 0 |
| stopped | Ctrl-C (SIGINT), or ``train.stop_after_steps`` | 130 after Ctrl-C, else 0 |
| preempted | SIGTERM | 0 |
| failed | an error (``result.json`` holds its line) | 2 (user error) / 1 |
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

EXIT_CTRL_C = 130
# Overrides a resume command drops: the run dir is given explicitly, and its own checkpoints win.
_DROP = ("hydra.run.dir=", "checkpoint.load_path=", "checkpoint.resume=", "train.stop_after_steps=", "+checkpoint.load_path=")


def status_of(result: dict[str, Any]) -> str:
    reason = result.get("stop_reason")
    if reason == "preempted":
        return "preempted"
    if reason in ("stopped", "stop_after_steps"):
        return "stopped"
    return "completed"


def resume_command(overrides: list[str], run_dir: str) -> str:
    kept = [o for o in overrides if not o.startswith(_DROP)]
    args = [*kept, "checkpoint.resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(["python -m hyperpar", *(shlex.quote(a) for a in args)])


def last_checkpoint(run_dir: str) -> Path | None:
    from hyperpar.checkpoint import directory as d

    return d.newest_complete(d.checkpoints_dir(run_dir))


def report(result: dict[str, Any], cfg: DictConfig, run_dir: str, overrides: list[str]) -> str:
    """Print the end-of-run lines (stderr); returns the status."""
    status = status_of(result)
    losses = result.get("losses") or []
    if status == "completed":
        if losses:
            print(f"[hyperpar] done: {len(losses)} steps, final loss {losses[-1]:.6f}; outputs in {run_dir}", file=sys.stderr)
        return status
    why = {"stopped": "Ctrl-C" if result.get("stop_reason") == "stopped" else "train.stop_after_steps",
           "preempted": "SIGTERM"}[status]
    ckpt = last_checkpoint(run_dir)
    at = f" after step {result['steps']} of {int(cfg.train.steps)}" if result.get("steps") is not None else ""
    saved = (f"checkpoint {ckpt.name} saved" if ckpt is not None and cfg.checkpoint.enabled
             else "nothing saved (checkpointing is off: add checkpoint=default)")
    print(f"[hyperpar] {status} ({why}){at}; {saved}; outputs in {run_dir}", file=sys.stderr)
    if ckpt is not None:
        print(f"[hyperpar] resume: {resume_command(overrides, run_dir)}", file=sys.stderr)
    return status


def exit_code(result: dict[str, Any]) -> int:
    return EXIT_CTRL_C if result.get("stop_reason") == "stopped" else 0
