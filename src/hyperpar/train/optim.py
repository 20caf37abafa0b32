"""Optimizer construction (the optim group's ``_target_``) and DTensor-aware gradient clipping."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperpar.errors import ConfigError
from hyperpar.train.lr import build_scheduler


def build_optimizer(model: nn.Module, *, name: str = "adamw", lr: float, weight_decay: float, beta1: float, beta2: float,
                    eps: float, schedule: str, warmup_steps: int, min_lr_ratio: float, total_steps: int):
    """AdamW with decay on matrices only (norms, biases and GDN decay parameters are not decayed)."""
    if name != "adamw":
        raise ConfigError(f"optim.name='{name}' is not supported", hint="use adamw")
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps, foreach=True)
    sched = build_scheduler(opt, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return opt, sched


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global L2 norm over (possibly sharded) grads; clips in place when ``max_norm > 0``."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
