"""Deterministic synthetic image and video samples for the vision-language models (``data=vl_dummy``).

Sample i is a pure function of (seed, i). Its shapes follow the model's vision config (patch size P,
temporal patch size Tp, merge size m, channels C) and token ids, exactly as the Qwen-VL processor
lays them out (MODELS.md 8.1, 9.1):

- image: ``text…, <vision_start>, <image> × t·h·w/m², <vision_end>, text…`` with ``pixel_values``
  (t·h·w, C·Tp·P·P) and ``image_grid_thw`` [[t, h, w]] (t = 1);
- video: ``text…`` then per temporal group ``<ts> <ts> <vision_start> <video> × h·w/m² <vision_end>``
  (two stand-in timestamp tokens), then ``text…``; ``pixel_values_videos`` / ``video_grid_thw``.

Every sample is exactly ``train.seq_len`` tokens with ``mm_token_type_ids`` (0 text, 1 image,
2 video) and pre-shifted ``labels`` (labels[t] is the target of position t); a placeholder is
never a target (-100), which is transformers' "placeholder labels = -100" before its shift.

So that a model can learn something, neither pixels nor text are noise: each item has a class c;
its patches are a fixed per-class pattern plus a smooth position term and a little noise, and the
text after the item is an arithmetic progression whose start and stride follow from c (so the first
token after an item is predictable only from its pixels). Text ids come from a small range
(``text_vocab``, default 512) so the loss drops within a few dozen steps.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.data.dummy import sample_generator
from hyperpar.data.registry import DataContext, register_dataset
from hyperpar.data.vl_collate import collate_vl
from hyperpar.errors import DataError

IGNORE = -100
TEXT, IMAGE, VIDEO = 0, 1, 2


def _setting(args: Any, name: str) -> Any:
    """A vision setting from the model args: on the args, their ``vision`` or ``vision_config``."""
    for owner in (args, getattr(args, "vision", None), getattr(args, "vision_config", None)):
        if owner is None:
            continue
        value = owner.get(name) if isinstance(owner, dict) else getattr(owner, name, None)
        if value is not None:
            return value
    return None


class VLDummySource:
    """``source[i]`` → dict with input_ids, labels, mm_token_type_ids and one image or one video."""

    collate = staticmethod(collate_vl)

    def __init__(
        self,
        *,
        seq_len: int,
        vocab_size: int,
        seed: int,
        num_samples: int,
        patch_size: int,
        temporal_patch_size: int,
        spatial_merge_size: int,
        in_channels: int,
        image_token_id: int,
        video_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        video_fraction: float = 0.25,
        text_fraction: float = 0.0,
        max_blocks: int = 4,
        max_frames: int = 2,
        num_classes: int = 16,
        noise: float = 0.05,
        text_vocab: int | None = 512,
    ) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = num_samples
        self.P, self.Tp, self.m, self.C = patch_size, temporal_patch_size, spatial_merge_size, in_channels
        self.patch_dim = in_channels * temporal_patch_size * patch_size**2
        self.image_id, self.video_id = image_token_id, video_token_id
        self.start_id, self.end_id = vision_start_token_id, vision_end_token_id
        specials = (image_token_id, video_token_id, vision_start_token_id, vision_end_token_id)
        bad = [s for s in specials if not 0 <= s < vocab_size]
        if bad:
            raise DataError(f"vl_dummy: special token ids {bad} are outside the vocabulary of {vocab_size}")
        # Plain text is drawn below the smallest special id (Qwen puts them at the end of the vocab).
        self.text_vocab = min(min(specials), text_vocab) if text_vocab else min(specials)
        if self.text_vocab < 2:
            raise DataError(f"vl_dummy: the special token ids {list(specials)} leave no room for text ids below them")
        if not (0.0 <= video_fraction and 0.0 <= text_fraction and video_fraction + text_fraction <= 1.0):
            raise DataError(f"vl_dummy: video_fraction {video_fraction} + text_fraction {text_fraction} must lie in [0, 1]")
        self.video_fraction, self.text_fraction = video_fraction, text_fraction
        self.max_blocks, self.max_frames = max(1, int(max_blocks)), max(1, int(max_frames))
        self.num_classes, self.noise = max(1, int(num_classes)), float(noise)
        smallest = 1 + 4 + 1  # prefix text, one image of one merge block with its markers, one text token
        if seq_len < smallest:
            raise DataError(f"vl_dummy: train.seq_len={seq_len} is too short for an image (needs ≥ {smallest})")

    def __len__(self) -> int:
        return self.num_samples

    # --- pieces ------------------------------------------------------------------------------

    def _progression(self, c: int, length: int) -> torch.Tensor:
        """The text after an item of class c: start and stride both follow from c."""
        v = self.text_vocab
        start = (c * (v // self.num_classes)) % v
        stride = 1 + c % 7
        return (start + stride * torch.arange(length, dtype=torch.int64)) % v

    def _class_pattern(self, c: int) -> torch.Tensor:
        """(C, P, P) pattern of class c: a pure function of (seed, c)."""
        g = torch.Generator().manual_seed((self.seed * 1_000_033 + 7_777 * (c + 1)) % (2**63))
        return torch.randn(self.C, self.P, self.P, generator=g)

    def _pixels(self, g: torch.Generator, c: int, t: int, h: int, w: int) -> torch.Tensor:
        """(t·h·w, C·Tp·P·P) patch rows in merge-block order for t temporal groups of h×w patches."""
        m = self.m
        base = self._class_pattern(c).view(1, 1, self.C, 1, self.P, self.P)
        # (row, col) of each patch in merge-block order, as the processor emits them.
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(-1, -1, w // m, m).permute(0, 2, 1, 3).reshape(-1)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, -1, -1).permute(0, 2, 1, 3).reshape(-1)
        smooth = 0.5 * (torch.sin(rows * 0.7) + torch.cos(cols * 0.9)).view(1, h * w, 1, 1, 1, 1)
        time = 0.1 * torch.arange(t * self.Tp, dtype=torch.float32).view(t, 1, 1, self.Tp, 1, 1)
        x = base + smooth + time  # (t, h·w, C, Tp, P, P): the row layout is (C, Tp, P, P)
        x = x + self.noise * torch.randn(x.shape, generator=g)
        return x.reshape(t * h * w, self.patch_dim)

    def _grid(self, g: torch.Generator, kind: int, budget_tokens: int, frames: int) -> tuple[int, int, int] | None:
        """A (t, h, w) patch grid whose placeholders and markers fit in ``budget_tokens``."""
        m = self.m
        bh = int(torch.randint(1, self.max_blocks + 1, (1,), generator=g))
        bw = int(torch.randint(1, self.max_blocks + 1, (1,), generator=g))
        extra = 4 if kind == VIDEO else 2  # per frame: <vision_start>, <vision_end> (+ 2 timestamp tokens)
        while frames * (bh * bw + extra) > budget_tokens:
            if bh == bw == 1:
                if frames == 1:
                    return None
                frames -= 1
            elif bh >= bw:
                bh -= 1
            else:
                bw -= 1
        return frames, bh * m, bw * m

    # --- samples -----------------------------------------------------------------------------

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = sample_generator(self.seed + 17, index)
        n = self.seq_len + 1  # tokens generated; input_ids are the first seq_len, labels the last seq_len
        u = float(torch.rand(1, generator=g))
        kind = TEXT if u < self.text_fraction else VIDEO if u < self.text_fraction + self.video_fraction else IMAGE
        c = int(torch.randint(0, self.num_classes, (1,), generator=g))
        prefix_len = int(torch.randint(1, 5, (1,), generator=g))
        ids: list[torch.Tensor] = [torch.randint(0, self.text_vocab, (prefix_len,), generator=g)]
        types: list[torch.Tensor] = [torch.zeros(prefix_len, dtype=torch.int64)]
        out: dict[str, torch.Tensor] = {}
        if kind != TEXT:
            frames = int(torch.randint(1, self.max_frames + 1, (1,), generator=g)) if kind == VIDEO else 1
            grid = self._grid(g, kind, n - prefix_len - 1, frames)
            if grid is None:
                raise DataError(f"vl_dummy: train.seq_len={self.seq_len} leaves no room for an image or video")
            t, h, w = grid
            per_frame = h * w // self.m**2
            if kind == IMAGE:
                ids.append(torch.tensor([self.start_id] + [self.image_id] * (t * per_frame) + [self.end_id]))
                types.append(torch.tensor([0] + [IMAGE] * (t * per_frame) + [0]))
                out["pixel_values"] = self._pixels(g, c, t, h, w)
                out["image_grid_thw"] = torch.tensor([[t, h, w]], dtype=torch.int64)
            else:
                for f in range(t):
                    stamp = [(2 * f) % self.text_vocab, (2 * f + 1) % self.text_vocab]  # stands in for "<1.0 seconds>"
                    ids.append(torch.tensor(stamp + [self.start_id] + [self.video_id] * per_frame + [self.end_id]))
                    types.append(torch.tensor([0, 0, 0] + [VIDEO] * per_frame + [0]))
                out["pixel_values_videos"] = self._pixels(g, c, t, h, w)
                out["video_grid_thw"] = torch.tensor([[t, h, w]], dtype=torch.int64)
        used = sum(x.numel() for x in ids)
        ids.append(self._progression(c, n - used))
        types.append(torch.zeros(n - used, dtype=torch.int64))
        seq = torch.cat(ids)
        tt = torch.cat(types)
        labels = seq[1:].clone()
        labels[tt[1:] != TEXT] = IGNORE
        return {"input_ids": seq[:-1].clone(), "labels": labels, "mm_token_type_ids": tt[:-1].clone(), **out}


@register_dataset("vl_dummy", extra=("video_fraction", "text_fraction", "max_blocks", "max_frames", "num_classes",
                                        "noise", "text_vocab"))
def build_vl_dummy(options: dict, ctx: DataContext) -> VLDummySource:
    args = ctx.model_args
    needed = ("patch_size", "temporal_patch_size", "spatial_merge_size", "image_token_id", "video_token_id",
              "vision_start_token_id", "vision_end_token_id")
    values = {k: _setting(args, k) for k in needed}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise DataError(
            f"data=vl_dummy needs a vision-language model (the model args have no {', '.join(missing)})",
            hint="use it with model=qwen3_vl_moe (or another VL model), or pick data=dummy",
        )
    extra = options.get("extra") or {}
    return VLDummySource(
        seq_len=ctx.seq_len,
        vocab_size=ctx.vocab_size,
        seed=ctx.seed,
        num_samples=ctx.num_samples,
        in_channels=int(_setting(args, "in_channels") or 3),
        **{k: int(v) for k, v in values.items()},
        video_fraction=float(extra.get("video_fraction", 0.25)),
        text_fraction=float(extra.get("text_fraction", 0.0)),
        max_blocks=int(extra.get("max_blocks", 4)),
        max_frames=int(extra.get("max_frames", 2)),
        num_classes=int(extra.get("num_classes", 16)),
        noise=float(extra.get("noise", 0.05)),
        text_vocab=extra.get("text_vocab", 512),
    )
