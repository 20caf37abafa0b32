"""Multimodal glue between the vision tower and a text decoder (MODELS.md 8.5, 9).

- ``get_rope_index``: 3-D (T, H, W) positions of text, image and video tokens, as transformers'
  ``get_rope_index`` of the Qwen3-VL / Qwen3.5 VL models.
- ``scatter_features``: vision features written over their placeholder tokens in row-major order,
  with a ``DataError`` when the counts differ.
- ``deepstack_inputs`` / ``add_deepstack``: DeepStack features aligned to the visual positions and
  added to the hidden states after the first text layers.
- ``embed_with_vision``: the whole front of a DeepStack-free VL model (Qwen3.5 dense and MoE):
  token embeddings, tower features over the placeholders, 3-D positions.
- ``VisionLanguageHooks``: the framework hooks (tying, init, buffers) every VL model shares.
- ``tower_runs_without_items``: within it, a call without images or videos still runs the tower
  (data-parallel ranks must run the same collectives, see its docstring).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn

from hyperpar.errors import DataError
from hyperpar.models.layers import init_param_by_module

TEXT, IMAGE, VIDEO = 0, 1, 2
_KIND = {IMAGE: "image", VIDEO: "video"}


def split_video_grids(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """(t, h, w) → t rows of (1, h, w): each temporal group has its own placeholder run."""
    grids = video_grid_thw.repeat_interleave(video_grid_thw[:, 0], dim=0).clone()
    grids[:, 0] = 1
    return grids


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values in a 1-D tensor: (value, start, end)."""
    n = types.numel()
    if n == 0:
        return []
    change = torch.nonzero(types[1:] != types[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), n]
    values = types[torch.tensor(bounds[:-1])].tolist()
    return [(int(v), s, e) for v, s, e in zip(values, bounds[:-1], bounds[1:])]


def get_rope_index(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    spatial_merge_size: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D rotary positions (3, B, S) and ``rope_deltas`` (B, 1) (MODELS.md 9.2).

    Per row, over the un-padded tokens, a running offset ``cur`` advances through runs of equal
    ``mm_token_type_ids`` (0 text, 1 image, 2 video): a text run of length L takes ``cur … cur+L−1``
    on all three axes; a vision run takes the next grid of its modality (videos split per temporal
    group) and gets T = cur, H = cur + merged row, W = cur + merged col, then
    ``cur += max(h, w) / m``. Grids are consumed in order across the whole batch. Padded positions
    (``attention_mask == 0``) get 0.
    """
    if mm_token_type_ids is None:
        raise DataError(
            "vision inputs need mm_token_type_ids (0 text, 1 image, 2 video per token) to build 3-D positions",
            hint="the Qwen-VL processor returns it next to input_ids",
        )
    B, S = input_ids.shape
    device = input_ids.device
    m = int(spatial_merge_size)
    grids = {
        IMAGE: image_grid_thw.tolist() if image_grid_thw is not None else [],
        VIDEO: split_video_grids(video_grid_thw).tolist() if video_grid_thw is not None else [],
    }
    used = {IMAGE: 0, VIDEO: 0}
    position_ids = torch.zeros(3, B, S, dtype=input_ids.dtype, device=device)
    deltas = []
    types_all = mm_token_type_ids.to("cpu", torch.int64)
    keep_all = attention_mask.to("cpu").bool() if attention_mask is not None else None
    for b in range(B):
        types = types_all[b] if keep_all is None else types_all[b][keep_all[b]]
        pieces, cur = [], 0
        for kind, start, end in _runs(types):
            length = end - start
            if kind == TEXT:
                pieces.append(torch.arange(cur, cur + length).expand(3, -1))
                cur += length
                continue
            if kind not in grids:
                raise DataError(f"mm_token_type_ids holds {kind}; expected 0 (text), 1 (image) or 2 (video)")
            name = _KIND[kind]
            if used[kind] >= len(grids[kind]):
                raise DataError(
                    f"row {b} has more {name} placeholder runs than {name} grids ({len(grids[kind])})",
                    hint=f"every {name} (video: every temporal group) needs its row in {name}_grid_thw",
                )
            t, h, w = grids[kind][used[kind]]
            used[kind] += 1
            gh, gw = h // m, w // m
            if t * gh * gw != length:
                raise DataError(
                    f"row {b}: a run of {length} {name} placeholder tokens meets a {name} grid ({t}, {h}, {w}) "
                    f"that gives {t * gh * gw} tokens"
                )
            tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
            hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
            ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
            cur += max(h, w) // m
        pos = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
        if keep_all is None:
            position_ids[:, b] = pos.to(device, position_ids.dtype)
        else:
            position_ids[:, b, keep_all[b].to(device)] = pos.to(device, position_ids.dtype)
        deltas.append((int(pos.max()) + 1 if pos.numel() else 0) - pos.shape[1])
    return position_ids, torch.tensor(deltas, device=device).unsqueeze(1)


def scatter_features(
    embeds: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, kind: str
) -> torch.Tensor:
    """Write ``features`` (n, H) over the positions where ``mask`` (B, S) is set, in row-major order.

    The placeholder embeddings are replaced (no gradient reaches their embedding rows from there).
    """
    n_tokens = int(mask.sum())
    n_features = int(features.shape[0])
    if n_tokens != n_features:
        raise DataError(
            f"{n_tokens} {kind} placeholder tokens in input_ids but {n_features} {kind} features from the vision tower",
            hint=f"each {kind} of grid (t, h, w) needs t*h*w/merge_size**2 placeholder tokens",
        )
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))


def deepstack_inputs(
    image_mask: torch.Tensor | None,
    video_mask: torch.Tensor | None,
    image_deepstack: list[torch.Tensor],
    video_deepstack: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The visual-position mask (B, S) and, per DeepStack level, one (n_visual, H) tensor whose rows
    follow the visual positions in row-major order (images and videos interleaved as in the sequence)."""
    if image_mask is not None and video_mask is not None:
        visual = image_mask | video_mask
        is_image = image_mask[visual]
        is_video = video_mask[visual]
        joint = []
        for img, vid in zip(image_deepstack, video_deepstack):
            out = img.new_zeros(int(visual.sum()), img.shape[-1])
            out = out.index_put((is_image.nonzero().flatten(),), img)
            joint.append(out.index_put((is_video.nonzero().flatten(),), vid))
        return visual, joint
    if image_mask is not None:
        return image_mask, list(image_deepstack)
    if video_mask is not None:
        return video_mask, list(video_deepstack)
    return None, []


def add_deepstack(hidden: torch.Tensor, visual_mask: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, S, H) with ``feature`` (n_visual, H) added at the visual positions (out of place)."""
    B, S, H = hidden.shape
    index = visual_mask.reshape(-1).nonzero().flatten()
    return hidden.reshape(B * S, H).index_add(0, index, feature.to(hidden.dtype)).view(B, S, H)


class DeepStackInjection(nn.Module):
    """``add_deepstack`` as a module (no parameters): the seam where a parallelizer hands it whole
    sequences (sequence parallelism shards the hidden states it adds into)."""

    def forward(self, hidden: torch.Tensor, visual_mask: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return add_deepstack(hidden, visual_mask, feature)


_IDLE_TOWER: ContextVar[bool] = ContextVar("hyperpar_idle_tower", default=False)


@contextmanager
def tower_runs_without_items(active: bool = True) -> Iterator[None]:
    """Within (when ``active``): a forward without images or videos still runs the vision tower,
    on one blank item, and hands its features on as an empty image.

    Under data parallelism every rank must run the same collectives: the tower's FSDP units
    all-gather in forward and reduce their gradients in backward. A rank whose micro-batch has no
    images, while another rank's has, runs the tower this way. The empty features are scattered
    over no placeholder, so the forward is unchanged bitwise; the tower's gradients from it are
    exact zeros, and the summed gradients equal the one-process run's."""
    token = _IDLE_TOWER.set(active)
    try:
        yield
    finally:
        _IDLE_TOWER.reset(token)


def _blank_item(visual: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels, grid) of the smallest item the tower takes: one merge block of zero patches."""
    a = visual.args
    m = a.spatial_merge_size
    return torch.zeros(m * m, a.patch_dim, device=device), torch.tensor([[1, m, m]], device=device)


def tower_features(
    visual: nn.Module | None,
    merge_unit: int,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, list[torch.Tensor]] | None, tuple[torch.Tensor, list[torch.Tensor]] | None]:
    """(features, deepstack features) for the images and for the videos, or None for an absent modality."""
    items = []
    for kind, pixels, grid in (("image", pixel_values, image_grid_thw), ("video", pixel_values_videos, video_grid_thw)):
        if (pixels is None) != (grid is None):
            have, lack = ("pixel values", "grid_thw") if grid is None else ("grid_thw", "pixel values")
            raise DataError(f"{kind} {have} given without the {kind} {lack}")
        items.append((pixels, grid) if pixels is not None and grid.shape[0] > 0 else None)
    present = [it for it in items if it is not None]
    if not present:
        if visual is None or not _IDLE_TOWER.get():
            return None, None
        feats, deep = visual(*_blank_item(visual, next(visual.parameters()).device))
        return (feats[:0], [d[:0] for d in deep]), None  # an empty image: no placeholder takes it
    if visual is None:
        raise DataError("this pipeline stage has no vision tower but received pixel values")
    # One tower pass for images and videos together: items are independent (per-item positions,
    # per-frame attention), and under FSDP each block is gathered once instead of twice.
    pixels = torch.cat([p for p, _ in present]) if len(present) > 1 else present[0][0]
    grids = torch.cat([g for _, g in present]) if len(present) > 1 else present[0][1]
    feats, deep = visual(pixels, grids)
    out, start = [], 0
    for it in items:
        if it is None:
            out.append(None)
            continue
        n = int(it[1].prod(-1).sum()) // merge_unit
        out.append((feats[start : start + n], [d[start : start + n] for d in deep]))
        start += n
    return out[0], out[1]


def embed_with_vision(
    embed_tokens: nn.Module,
    visual: nn.Module | None,
    args,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input embeddings (B, S, H) with vision features at their placeholders, position ids) for a
    VL model without DeepStack; ``args`` holds ``vision`` and the image / video token ids. Positions
    are the 3-D ``get_rope_index`` ones when vision grids are given and no positions are."""
    embeds = embed_tokens(input_ids)
    vision = args.vision
    image, video = (None if f is None else f[0] for f in tower_features(
        visual, vision.merge_unit, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw))
    if image is not None:
        embeds = scatter_features(embeds, input_ids == args.image_token_id, image, "image")
    if video is not None:
        embeds = scatter_features(embeds, input_ids == args.video_token_id, video, "video")
    if position_ids is None and (image_grid_thw is not None or video_grid_thw is not None):
        position_ids, _ = get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
            spatial_merge_size=vision.spatial_merge_size, attention_mask=attention_mask,
        )
    return embeds, position_ids


class VisionLanguageHooks:
    """Tying and init hooks (see hyperpar.models.spec) of a VL model laid out like the checkpoints:
    ``self.model.visual`` (None on a pipeline stage without it), ``self.model.language_model``,
    ``self.lm_head``; ``self.args`` has ``text`` and the top-level ``tie_word_embeddings``."""

    model: nn.Module
    lm_head: nn.Linear | None
    args: Any

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with the embedding when the top-level config ties them (again
        after ``to_empty``, which materialises each module separately)."""
        emb = self.model.language_model.embed_tokens
        if self.args.tie_word_embeddings and self.lm_head is not None and emb is not None:
            self.lm_head.weight = emb.weight

    def init_param(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill the full-shaped fp32 tensor of parameter ``name`` in place (a pure function of gen)."""
        prefix = "model.visual."
        if name.startswith(prefix) and self.model.visual is not None:
            self.model.visual.init_param(name[len(prefix) :], full, gen)
        else:
            init_param_by_module(self, name, full, gen, std=self.args.text.initializer_range)

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers on the current device and restore the weight tie."""
        self.model.language_model.rotary_emb.reset_buffers()
        self.tie_weights()
