"""Learning-rate schedules as multipliers of the base LR: linear warmup, then cosine / linear / constant."""

from __future__ import annotations

import logging
import math
from functools import partial

import torch

from hyperpar.errors import ConfigError

SCHEDULES = ("cosine", "linear", "constant")
log = logging.getLogger("hyperpar")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier for the LR used at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule='{schedule}' is not one of {', '.join(SCHEDULES)}")
    if 0 < total_steps < warmup_steps:
        log.warning("optim.warmup_steps=%d > train.steps=%d: the learning rate is still rising when the run ends "
                    "(at most %.3g x optim.lr) and never decays", warmup_steps, total_steps, total_steps / warmup_steps)
    fn = partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def resync(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each param group's LR from the schedule at its loaded position: loading a scheduler restores
    the LR the saving run's schedule chose for the next step, but the schedule's shape (warmup, length,
    kind) is the resuming run's config. Same schedule: the same value, bitwise (the same product)."""
    groups = scheduler.optimizer.param_groups
    for group, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
