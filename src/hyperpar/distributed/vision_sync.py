"""Which forwards must run the vision tower without images (see ``tower_runs_without_items``).

Data-parallel ranks hold different rows. The vision tower's FSDP units all-gather and reduce on
every rank of the group together, so in each forward either every rank runs the tower or none
does. One all-reduce per step over the data-parallel group finds the forwards where some rank has
images; the ranks without images in those forwards run the tower on a blank item. Where no rank
has images the tower stays idle everywhere, as in one process (its parameters get no gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyperpar.distributed.pipeline_vl import VISION

GRID_KEYS = tuple(grid for _, grid, _ in VISION)


def has_vision(batch: dict[str, torch.Tensor]) -> bool:
    """Whether a micro-batch holds at least one image or video."""
    return any(batch.get(k) is not None and batch[k].shape[0] > 0 for k in GRID_KEYS)


def idle_tower_forwards(local: list[bool], group, device: torch.device) -> list[bool]:
    """Per forward of this step: True where this rank has no images but another rank of ``group``
    has some (the same number of forwards on every rank)."""
    if group is None or dist.get_world_size(group) == 1 or not local:
        return [False] * len(local)
    anywhere = torch.tensor(local, dtype=torch.int32, device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group)
    return [bool(a) and not mine for a, mine in zip(anywhere.tolist(), local)]
