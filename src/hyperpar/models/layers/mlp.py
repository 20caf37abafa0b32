"""SwiGLU feed-forward (dense MLP, shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.cpu_matmul import Linear


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free (HF names)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
