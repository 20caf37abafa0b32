"""RMSNorm variants used by the Qwen families (MODELS.md 3.1, 13).

The offset and plain variants differ in more than the weight convention: they cast back to the
activation dtype at different points, which matters for bf16 parity with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim.

    ``offset=True`` (Qwen3.5 decoder, q/k norms): ``y = (x̂ · (1 + w)).to(dtype)``, all in fp32,
    checkpoint weight 0 means scale 1. ``offset=False`` (Qwen3-VL-MoE): ``y = w · x̂.to(dtype)``,
    weight 1 means scale 1.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (_normalize_fp32(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * _normalize_fp32(x, self.eps).to(x.dtype)

    def init_value(self) -> float:
        """The weight value that makes the norm a pure normalisation (the checkpoint convention)."""
        return 0.0 if self.offset else 1.0

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


class GatedRMSNorm(nn.Module):
    """GatedDeltaNet output norm: ``[w · x̂.to(dtype)] · silu(z)`` with the gate in fp32.

    Plain weight (init 1), shared by all value heads: x and z are (..., dv).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.weight * _normalize_fp32(x, self.eps).to(dtype)
        return (y * F.silu(z.float())).to(dtype)

    def init_value(self) -> float:
        return 1.0

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
