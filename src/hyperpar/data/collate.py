"""Stack per-sample dicts into a micro-batch."""

from __future__ import annotations

import torch


def collate_text(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = samples[0].keys()
    return {k: torch.stack([s[k] for s in samples]) for k in keys}
