"""Per-patch geometry of the vision tower: coordinates, learned-position resampling, 2-D rotary and
the per-frame attention segments (MODELS.md 8.1–8.3).

Everything here depends only on ``grid_thw`` (never on pixel values), so it is computed once per
forward and shared by all blocks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hyperpar.errors import DataError
from hyperpar.models.layers.rope import apply_rotary


def _grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def patch_coords(grid_thw: torch.Tensor, merge: int, device: torch.device | None = None) -> torch.Tensor:
    """(row, col) of every patch row of ``pixel_values``: (N, 2) long.

    Within an item the rows run in spatial-merge-block order (block row, block col, row inside the
    block, col inside the block) and the frame pattern repeats for each of the t temporal groups.
    """
    out = []
    for t, h, w in _grid_list(grid_thw):
        if h % merge or w % merge:
            raise DataError(f"grid ({t}, {h}, {w}) is not a multiple of the spatial merge size {merge}")
        # Indices shaped (block row, in-block row, block col, in-block col), then block-major order.
        rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        frame = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(frame.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long, device=device)


def _axis_taps(coord: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps and weights per coordinate for bilinear resampling of ``side`` samples onto ``size``
    points with align_corners=True: source ``c·(side − 1)/(size − 1)`` (0 when size is 1)."""
    src = coord.double() * (side - 1) / (size.double() - 1).clamp(min=1)
    lo = src.floor().clamp(0, side - 1)
    frac = (src - lo).float()
    lo = lo.long()
    hi = (lo + 1).clamp(max=side - 1)
    return torch.stack([lo, hi], dim=-1), torch.stack([1 - frac, frac], dim=-1)


def position_interpolation(
    grid_thw: torch.Tensor, coords: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the flattened (side × side) learned position table and bilinear weights: (N, 4) each.

    Equal to ``F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)`` read at each
    patch's (row, col).
    """
    grids = _grid_list(grid_thw)
    hw = torch.tensor([[h, w] for _, h, w in grids], dtype=torch.long).view(-1, 2)
    counts = torch.tensor([t * h * w for t, h, w in grids], dtype=torch.long)
    sizes = hw.repeat_interleave(counts, dim=0).to(coords.device)  # (N, 2): the (h, w) of each patch's item
    rt, rw = _axis_taps(coords[:, 0], sizes[:, 0], side)
    ct, cw = _axis_taps(coords[:, 1], sizes[:, 1], side)
    index = (rt.unsqueeze(-1) * side + ct.unsqueeze(-2)).reshape(-1, 4)
    weight = (rw.unsqueeze(-1) * cw.unsqueeze(-2)).reshape(-1, 4)
    return index, weight


def vision_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``θ^(−2j/(hd/2))`` for j < hd/4 (fp32): each of the two spatial axes rotates hd/2 dims."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.int64, device=device).float() / half))


def vision_rotary(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) of shape (N, hd): angles ``[row·f, col·f]`` duplicated to the full head dim."""
    inv = vision_inv_freq(head_dim, theta, coords.device)
    angles = (coords.float().unsqueeze(-1) * inv).flatten(1)  # (N, hd/2): row freqs, then col freqs
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, hd) in fp32 (as transformers does for the vision tower), cast back."""
    return apply_rotary(x.float().unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)).squeeze(0).to(x.dtype)


def frame_runs(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """Attention segments as runs ``(count, length)``: ``count`` consecutive frames of ``length`` patches.

    A frame (h·w patches of one temporal group) attends only to itself. Consecutive frames of equal
    size (all frames of a video, equal-sized images in a row) form one run, which the attention
    processes as one batch.
    """
    runs: list[list[int]] = []
    for t, h, w in _grid_list(grid_thw):
        if t <= 0 or h * w <= 0:
            continue
        if runs and runs[-1][1] == h * w:
            runs[-1][0] += t
        else:
            runs.append([t, h * w])
    return [(c, n) for c, n in runs]


def cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative frame boundaries (num_frames + 1,) int32, for kernels that take varlen input."""
    lengths = [h * w for t, h, w in _grid_list(grid_thw) for _ in range(t)]
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
