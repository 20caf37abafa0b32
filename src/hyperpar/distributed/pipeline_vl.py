"""Vision-language models in a pipeline: what the schedule cannot chunk, and what travels between stages.

The schedule splits every input along the batch dimension into equal micro-batches. Images and
videos are ragged (their patch rows are concatenated, a row holds any number of them), so they do
not go through the schedule: ``StepVision`` holds the step's pixels and grids with the row each
image or video belongs to, the first stage receives its micro-batch's row indices and takes the
images of those rows. Everything per token is computed once per loader micro-batch, exactly as
one process does, before the schedule: the 3-D rotary positions (``get_rope_index``) and the
visual mask. Positions reach every stage; the mask reaches the stages whose layers add DeepStack
features.

Carried between stages (``carry_plan``), next to the hidden states: each DeepStack level a later
stage's layer adds, as a dense (B, S, H) tensor (zero off the visual positions), and the merged
input embeddings when the last stage trains the MTP head. Their gradients flow back like the
hidden states' to the vision tower on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperpar.errors import DataError

# (pixel key, grid key, the args' placeholder token id attribute)
VISION = (("pixel_values", "image_grid_thw", "image_token_id"), ("pixel_values_videos", "video_grid_thw", "video_token_id"))
VISION_KEYS = {k for pixels, grid, _ in VISION for k in (pixels, grid)}


def is_vl(args) -> bool:
    return hasattr(args, "vision") and hasattr(args, "text")


def deepstack_levels(args) -> int:
    """DeepStack features the text decoder adds (after layers 0 .. n-1); 0 for models without."""
    return len(getattr(args.vision, "deepstack_visual_indexes", ()) or ()) if is_vl(args) else 0


@dataclass
class _Items:
    pixels: torch.Tensor  # (P, D) patch rows of every image (or video) of the step, in row order
    grid: torch.Tensor  # (n, 3)
    owner: torch.Tensor  # (n,) the row of the step each belongs to
    patch_start: torch.Tensor  # (n + 1,) first patch row of each, and the total


class StepVision:
    """The step's images and videos, selectable by a contiguous range of its rows."""

    def __init__(self, items: dict[str, _Items]) -> None:
        self.items = items

    def to(self, device: torch.device) -> "StepVision":
        return StepVision({k: _Items(it.pixels.to(device), it.grid.to(device), it.owner.to(device), it.patch_start.to(device))
                           for k, it in self.items.items()})

    def has_items(self, lo: int, hi: int) -> bool:
        """Whether any image or video belongs to rows [lo, hi)."""
        return any(bool(((it.owner >= lo) & (it.owner < hi)).any()) for it in self.items.values())

    def rows(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """pixel values and grids of the images / videos of rows [lo, hi) (a modality they lack is left out)."""
        out: dict[str, torch.Tensor] = {}
        for (pixels, grid, _), it in ((v, self.items.get(v[0])) for v in VISION):
            if it is None:
                continue
            idx = ((it.owner >= lo) & (it.owner < hi)).nonzero().flatten()
            if idx.numel() == 0:
                continue
            a, b = int(idx[0]), int(idx[-1]) + 1
            out[pixels] = it.pixels[int(it.patch_start[a]):int(it.patch_start[b])]
            out[grid] = it.grid[a:b]
        return out


def _owners(input_ids: torch.Tensor, grid: torch.Tensor, token_id: int, merge_unit: int, kind: str) -> torch.Tensor:
    """The row of each image (video) of a micro-batch, from its placeholder count (images are in row order)."""
    per_row = (input_ids == token_id).sum(1).cumsum(0)
    need = grid.prod(-1) // merge_unit
    if int(need.sum()) != int(per_row[-1]):
        raise DataError(f"{int(per_row[-1])} {kind} placeholder tokens in input_ids but the {kind} grids need {int(need.sum())}",
                        hint=f"each {kind} of grid (t, h, w) needs t*h*w/merge_size**2 placeholder tokens")
    starts = need.cumsum(0) - need
    return torch.searchsorted(per_row, starts, right=True)


def step_inputs(micro_batches: list[dict[str, torch.Tensor]], args) -> tuple[dict[str, torch.Tensor], StepVision | None]:
    """The step's per-row tensors (micro-batches concatenated along the batch) with 3-D positions
    for every micro-batch, and its ``StepVision`` (None without vision)."""
    from hyperpar.models.multimodal import get_rope_index

    vision = args.vision
    per_row: list[dict[str, torch.Tensor]] = []
    parts: dict[str, list[tuple]] = {}
    offset = 0
    for mb in micro_batches:
        ids = mb["input_ids"]
        B, S = ids.shape
        rows = {k: v for k, v in mb.items() if k not in VISION_KEYS and k != "mm_token_type_ids"}
        # Every step hands the schedule the same inputs (it keeps the chunking of its first step):
        # positions are always explicit 4-row (text, T, H, W) ones, plain 0..S-1 for a step without images
        # (a 3-row form would lose the document starts of packed rows).
        pos = mb.get("position_ids")
        if pos is None and any(mb.get(grid) is not None for _, grid, _ in VISION):
            pos, _ = get_rope_index(ids, mb.get("mm_token_type_ids"), mb.get("image_grid_thw"), mb.get("video_grid_thw"),
                                    spatial_merge_size=vision.spatial_merge_size, attention_mask=mb.get("attention_mask"))
        elif pos is None:
            pos = torch.arange(S, device=ids.device).expand(4, B, S)
        elif pos.dim() == 2:  # packed text rows: the text row keeps their document starts
            pos = pos.unsqueeze(0).expand(4, B, S)
        if pos.shape[0] == 3:  # (T, H, W) rows carry no document starts: a text row without any
            pos = torch.cat([torch.arange(S, device=pos.device).expand(1, B, S), pos])
        rows["position_ids"] = pos
        per_row.append(rows)
        for pixels, grid, token in VISION:
            if grid in mb and mb[grid].shape[0] > 0:
                owner = _owners(ids, mb[grid], getattr(args, token), vision.merge_unit, pixels) + offset
                parts.setdefault(pixels, []).append((mb[pixels], mb[grid], owner))
        offset += B
    keys = per_row[0].keys()
    if any(r.keys() != keys for r in per_row):
        raise DataError("the micro-batches of a step carry different inputs "
                        f"({sorted(set().union(*(r.keys() for r in per_row)) - set(keys))} not in every one)")
    shapes = {r["position_ids"].shape[0] for r in per_row if "position_ids" in r and r["position_ids"].dim() == 3}
    if len(shapes) > 1:
        raise DataError(f"the micro-batches of a step mix position rows {sorted(shapes)}")
    rows = {k: torch.cat([r[k] for r in per_row], dim=1 if k == "position_ids" and per_row[0][k].dim() == 3 else 0)
            for k in keys}
    if not parts:
        return rows, None
    items = {}
    for pixels, got in parts.items():
        grid = torch.cat([g for _, g, _ in got])
        patches = grid.prod(-1)
        items[pixels] = _Items(torch.cat([p for p, _, _ in got]), grid, torch.cat([o for _, _, o in got]),
                               torch.cat([patches.new_zeros(1), patches.cumsum(0)]))
    return rows, StepVision(items)


def visual_mask(input_ids: torch.Tensor, args) -> torch.Tensor:
    """(B, S) bool: the image and video placeholder positions (where DeepStack adds its features)."""
    return (input_ids == args.image_token_id) | (input_ids == args.video_token_id)


def carry_plan(ranges: list[range], args, mtp: bool) -> list[list[str]]:
    """Per stage boundary s -> s + 1: the names of what travels next to the hidden states,
    "deepstack.<n>" for each DeepStack level a layer after the boundary adds, and "embeds" (the
    merged input embeddings) when the last stage trains the MTP head on them."""
    levels = deepstack_levels(args)
    plan = []
    for s in range(len(ranges) - 1):
        later = ranges[s + 1].start
        names = [f"deepstack.{n}" for n in range(levels) if n >= later]
        if mtp:
            names.append("embeds")
        plan.append(names)
    return plan
