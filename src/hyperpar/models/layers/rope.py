"""Text rotary embedding with interleaved mRoPE and partial rotary (MODELS.md 4.2, 4.3).

The model owns one ``RotaryEmbedding`` and computes (cos, sin) once per forward; decoder layers
only receive the tensors. Keeping the module out of the layers lets activation checkpointing and
pipeline splitting treat every layer as a pure function of (hidden, cos, sin).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``θ^(−2j/rot)`` for j < rot/2, in fp32 (rot/2,)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponent)


def mrope_axis_index(num_freqs: int, mrope_section: Sequence[int]) -> torch.Tensor:
    """Axis (0 = T, 1 = H, 2 = W) that drives each frequency in the interleaved layout (num_freqs,).

    H takes j ≡ 1 (mod 3) below 3·section[1], W takes j ≡ 2 (mod 3) below 3·section[2], T the rest;
    section[0] is never read (that is how transformers does it).
    """
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    for a, offset in ((1, 1), (2, 2)):
        end = min(3 * int(mrope_section[a]), num_freqs)
        axis[offset:end:3] = a
    return axis


def _positions_thw(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) / (3, B, S) / (4, B, S) → (3, B, S) rope positions (row 0 of the 4-row form is text)."""
    if position_ids.dim() == 2:
        return position_ids.unsqueeze(0).expand(3, -1, -1)
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[1:]
    if position_ids.dim() == 3 and position_ids.shape[0] == 3:
        return position_ids
    raise ValueError(f"position_ids must be (B, S), (3, B, S) or (4, B, S); got {tuple(position_ids.shape)}")


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) of shape (B, S, rot) for rot = int(head_dim · partial_rotary_factor).

    ``mrope_section=None`` gives plain 1-D RoPE (3-D positions are then rejected).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        partial_rotary_factor: float = 1.0,
        mrope_section: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"rotary dim {self.rotary_dim} must be positive and even")
        self.theta = float(theta)
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, self.theta), persistent=False)
        axis = mrope_axis_index(self.rotary_dim // 2, self.mrope_section or [0, 0, 0])
        self.register_buffer("mrope_axis", axis, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers on the current device (after ``to_empty``)."""
        device = self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.rotary_dim, self.theta, device=device)
        self.mrope_axis = mrope_axis_index(self.rotary_dim // 2, self.mrope_section or [0, 0, 0]).to(device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # a blanket model.to(bf16) cast the buffer: rebuild exactly
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, device=inv_freq.device)
        # Every frequency reads the same row when the three rows are one tensor broadcast; skip the
        # gather then (plain text, the common training case).
        if position_ids.dim() == 2:
            angles = position_ids.float().unsqueeze(-1) * inv_freq  # (B, S, rot/2)
        else:
            if self.mrope_section is None:
                raise ValueError("3-D position_ids need an mRoPE section")
            thw = _positions_thw(position_ids).float()  # (3, B, S)
            # angle[b, s, j] = pos[axis(j), b, s] · inv_freq[j]
            per_freq = thw.index_select(0, self.mrope_axis)  # (rot/2, B, S)
            angles = per_freq.permute(1, 2, 0) * inv_freq  # (B, S, rot/2)
        emb = torch.cat((angles, angles), dim=-1)  # (B, S, rot)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rot dims of x (B, S, heads, hd) with cos/sin (B, S, rot); the rest pass through.

    Pairs are (i, i + rot/2) — the half-split convention of the HF checkpoints.
    """
    rot = cos.shape[-1]
    cos = cos.unsqueeze(2)  # (B, S, 1, rot)
    sin = sin.unsqueeze(2)
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
