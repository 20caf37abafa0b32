"""Patch merger: m×m neighbouring patches → one text-width token (MODELS.md 8.4, 8.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.cpu_matmul import Linear


class PatchMerger(nn.Module):
    """``fc2(gelu(fc1(norm(x))))`` over groups of m² consecutive patch rows (one merge block).

    ``postshuffle_norm=False`` (the final ``merger``): LayerNorm(Dv) on each patch before grouping.
    ``postshuffle_norm=True`` (DeepStack mergers): LayerNorm(m²·Dv) on the grouped row. The GELU is
    exact (erf), unlike the blocks' tanh approximation.
    """

    def __init__(self, hidden_size: int, merge_size: int, out_size: int, *, postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merged_size = hidden_size * merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = Linear(self.merged_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, Dv) patch rows in merge-block order → (N / m², Dout)."""
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
