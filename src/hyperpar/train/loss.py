"""Causal-LM loss as a token mean over the whole global batch.

Each micro-batch contributes sum(token losses) / (valid tokens of the global batch, reduced over all
data-parallel ranks), and gradients are summed over ranks, so N processes compute exactly the loss
of one process that sees the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32; ``labels`` are pre-shifted, -100 is ignored."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
