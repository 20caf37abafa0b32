"""Pre-tokenized samples from safetensors or ``.pt`` files (``data=preset``).

``data.path`` is one file or a folder of ``*.safetensors`` / ``*.pt`` / ``*.pth`` files (read in
name order and concatenated along the sample axis). ``.pt`` files are read with
``torch.load(weights_only=True)`` and must hold a dict of tensors. Each file holds N rows:

==========================  ==============  ======================================================
key                         shape           meaning
==========================  ==============  ======================================================
``input_ids``               (N, S)          token ids (required)
``labels``                  (N, S)          pre-shifted targets, -100 ignored (``extra.labels_shifted:
                                            false``: Hugging Face style, shifted here); default:
                                            ``input_ids`` shifted, vision placeholders ignored
``attention_mask``          (N, S)          1 = real token; zeros become ignored labels, and the
                                            mask is passed on: each padding run is a document of its
                                            own (no real token attends to it) and leaves the MoE
                                            router statistics; text rows without position_ids get
                                            positions restarting at 0 on every span
``position_ids``            (N, S) |        1-D positions, or 3-D/4-D (mRoPE T, H, W [, text])
                            (N, C, S) |     rows per sample; HF's (C, N, S) layout is accepted too
                            (C, N, S)
``mm_token_type_ids``       (N, S)          0 text, 1 image placeholder, 2 video placeholder
``pixel_values``            (P, D)          patch rows of every image, image after image
``image_grid_thw``          (n, 3)          (t, h, w) patches of each image: image k owns t*h*w rows
``image_counts``            (N,)            images per row (optional, see below)
``pixel_values_videos``     (Pv, D)         the same for videos
``video_grid_thw``          (m, 3)
``video_counts``            (N,)
==========================  ==============  ======================================================

Images (and videos) belong to rows in order. Which row owns which image comes from
``image_counts``; without it, from each row's placeholder count (``mm_token_type_ids``, else the
model's or ``extra.image_token_id``), an image of grid (t, h, w) filling t*h*w / m**2 placeholders
(m = the spatial merge size, ``extra.spatial_merge_size`` or the model's, default 2); a single row
owns them all. Rows shorter than ``train.seq_len`` are right-padded (labels -100); longer text rows
are truncated, longer VL rows are an error.

Sample ``i`` is row ``i mod N`` of epoch ``i div N`` (reshuffled per epoch with ``shuffle: true``),
so the source has exactly ``ctx.num_samples`` samples. VL samples carry their own patch rows and
grids, and the source's ``collate`` concatenates them across the micro-batch
(:mod:`hyperpar.data.vl_collate`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hyperpar.data.hf import IGNORE_INDEX, EpochOrder, resolve_path
from hyperpar.data.pad import extend_tokens
from hyperpar.data.registry import DataContext, register_dataset
from hyperpar.data.vl_collate import VISION_KEYS, collate_vl
from hyperpar.errors import DataError

log = logging.getLogger("hyperpar")

SUFFIXES = (".safetensors", ".pt", ".pth")
TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "mm_token_type_ids")
_COUNTS = {"image_grid_thw": "image_counts", "video_grid_thw": "video_counts"}
KNOWN_KEYS = set(TEXT_KEYS) | {k for pair in VISION_KEYS for k in pair} | set(_COUNTS.values())


def preset_files(path: str | None) -> list[Path]:
    if not path:
        raise DataError("data.path is not set", hint="give a .safetensors / .pt file or a folder of them")
    local = Path(resolve_path(path))
    if local.is_file():
        return [local]
    if local.is_dir():
        files = sorted(p for p in local.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
        if not files:
            raise DataError(f"{path}: no {' / '.join(SUFFIXES)} files in the folder")
        return files
    raise DataError(f"data.path {path!r} does not exist")


class _Tensors:
    """Named tensors of one file; the pixel tensors stay on disk (memory-mapped) and are read per sample."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None
        self._data: dict[str, torch.Tensor] = {}
        try:
            if path.name.endswith(".safetensors"):
                from safetensors import safe_open

                self._handle = safe_open(str(path), framework="pt")
                self.keys = list(self._handle.keys())
            else:
                try:
                    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                    data = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
                    raise DataError(f"{path}: expected a dict of tensors")
                self._data = data
                self.keys = list(data)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors / pickle errors: the file is not what we read
            kind = "a safetensors file" if path.name.endswith(".safetensors") else "a torch.save file of tensors"
            # The raw error (e.g. "KeyError: 101" for text in a .pt) says little; name the file and what it is not.
            raise DataError(f"{path}: cannot read it: not {kind} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'})",
                            hint="data=preset reads .safetensors / .pt files holding input_ids (see docs/guide/data.md)") from None

    def get(self, key: str) -> torch.Tensor | None:
        if key not in self.keys:
            return None
        return self._handle.get_tensor(key) if self._handle is not None else self._data[key]

    def shape(self, key: str) -> tuple[int, ...]:
        if self._handle is not None:
            return tuple(self._handle.get_slice(key).get_shape())
        return tuple(self._data[key].shape)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if self._handle is not None:
            return self._handle.get_slice(key)[start:stop]
        return self._data[key][start:stop].clone()


def _assign(grids: torch.Tensor, counts: torch.Tensor | None, placeholders: torch.Tensor | None, merge: int,
            rows: int, what: str, path: Path) -> torch.Tensor:
    """first[r]..first[r+1]: the grid indices that row r owns."""
    n = grids.shape[0]
    if counts is not None:
        counts = counts.reshape(-1).to(torch.int64)
        if counts.shape[0] != rows or int(counts.sum()) != n:
            raise DataError(f"{path}: {what}_counts must have one entry per row and sum to {n} {what}s")
    elif rows == 1:
        counts = torch.tensor([n])
    elif placeholders is not None:
        per_grid = (grids.prod(dim=1) // merge**2).tolist()
        counts = torch.zeros(rows, dtype=torch.int64)
        k = 0
        for r, need in enumerate(placeholders.tolist()):
            got = 0
            while got < need and k < n:
                got += per_grid[k]
                k += 1
                counts[r] += 1
            if got != need:
                raise DataError(f"{path}: row {r} has {need} {what} placeholders but its {what}s fill {got}",
                                hint=f"check {what}_grid_thw and the spatial merge size ({merge}), or give {what}_counts")
        if k != n:
            raise DataError(f"{path}: {n - k} {what}s are left over after the last row's placeholders")
    else:
        raise DataError(f"{path}: cannot tell which {what}s belong to which row",
                        hint=f"add {what}_counts (N,) or mm_token_type_ids, or set data.extra.{what}_token_id")
    first = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=first[1:])
    return first


class _Shard:
    """One file's rows, checked once at build time."""

    def __init__(self, path: Path, *, labels_shifted: bool, merge: int, token_ids: dict[str, int | None]) -> None:
        t = self.tensors = _Tensors(path)
        self.path = path
        unknown = sorted(set(t.keys) - KNOWN_KEYS)
        if unknown:
            log.warning("data: %s: ignoring tensors %s", path, ", ".join(unknown))
        ids = t.get("input_ids")
        if ids is None:
            raise DataError(f"{path}: no input_ids tensor (keys: {', '.join(t.keys)})")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.is_floating_point():
            raise DataError(f"{path}: input_ids must be integer (N, S), got {tuple(ids.shape)} {ids.dtype}")
        self.ids = ids.to(torch.int64)
        self.n, self.seq = ids.shape

        def per_token(key: str) -> torch.Tensor | None:
            v = t.get(key)
            if v is None:
                return None
            v = v.reshape(self.n, -1) if v.numel() == self.n * self.seq else v
            if tuple(v.shape) != (self.n, self.seq):
                raise DataError(f"{path}: {key} has shape {tuple(v.shape)}, input_ids {tuple(ids.shape)}")
            return v

        self.attention_mask = per_token("attention_mask")
        self.mm = per_token("mm_token_type_ids")
        self.position_ids = self._positions(t.get("position_ids"))
        if self.mm is None and any(token_ids.values()) and any(t.get(g) is not None for _, g in VISION_KEYS):
            self.mm = torch.zeros_like(self.ids, dtype=torch.int32)
            for value, what in ((1, "image"), (2, "video")):
                if token_ids.get(what) is not None:
                    self.mm[self.ids == token_ids[what]] = value
        self.labels = self._labels(per_token("labels"), labels_shifted)

        self.vision: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # grid key -> grids, first, row offsets
        for (pixels, grid), value, what in zip(VISION_KEYS, (1, 2), ("image", "video")):
            grids = t.get(grid)
            if grids is None and pixels not in t.keys:
                continue
            if grids is None or pixels not in t.keys:
                raise DataError(f"{path}: {pixels} and {grid} come together")
            grids = grids.to(torch.int64).reshape(-1, 3)
            rows_per = grids.prod(dim=1)
            total = t.shape(pixels)[0]
            if int(rows_per.sum()) != total:
                raise DataError(f"{path}: {pixels} has {total} rows but {grid} accounts for {int(rows_per.sum())} (sum of t*h*w)")
            placeholders = (self.mm == value).sum(dim=1) if self.mm is not None else None
            first = _assign(grids, t.get(_COUNTS[grid]), placeholders, merge, self.n, what, path)
            offsets = torch.zeros(grids.shape[0] + 1, dtype=torch.int64)
            torch.cumsum(rows_per, 0, out=offsets[1:])
            self.vision[grid] = (grids, first, offsets)
        self.is_vl = bool(self.vision) or (self.position_ids is not None and self.position_ids.dim() == 3)
        self.emit_mm = self.is_vl
        self.emit_mask = False

    def pass_mask(self, vl_source: bool = False) -> None:
        """Hand the attention mask to the model (all ones where the file has none, so every row of the
        source has one and the source's own right padding is masked too). Text rows get positions
        restarting on every span, except in a VL source: there a text-only file keeps the layout its
        VL rows have (see ``conform``), so its rows can share a micro-batch with them."""
        if self.attention_mask is None:
            self.attention_mask = torch.ones_like(self.ids)
        self.emit_mask = True
        if self.position_ids is None and not vl_source:
            self.position_ids = span_positions(self.attention_mask)

    def conform(self, pos_rows: int | None) -> None:
        """Give a text-only file of a VL source what its VL rows carry, so any rows can share a micro-batch."""
        if self.mm is None and not self.vision:
            self.mm = torch.zeros_like(self.ids, dtype=torch.int32)
        self.emit_mm = self.mm is not None
        self.fill_positions(pos_rows)

    def fill_positions(self, pos_rows: int | None) -> None:
        """Where the file has no positions but others of the source have them (``pos_rows`` rows each,
        1 for text): one document per row, so every sample carries the same keys."""
        if self.position_ids is None and pos_rows is not None:
            if self.vision:  # arange positions would silently replace the mRoPE positions of its images
                raise DataError(f"{self.path}: vision-language rows without position_ids, but other preset files "
                                "have them", hint="store position_ids in every VL file, or in none")
            pos = torch.arange(self.seq).expand(self.n, self.seq)
            self.position_ids = (pos if pos_rows == 1 else pos.unsqueeze(1).expand(self.n, pos_rows, self.seq)).contiguous()

    def _positions(self, pos: torch.Tensor | None) -> torch.Tensor | None:
        if pos is None:
            return None
        n, s = self.n, self.seq
        if pos.dim() == 1 and n == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() == 3 and pos.shape[1] == n and pos.shape[0] in (3, 4) and pos.shape[0] != n:
            pos = pos.transpose(0, 1)  # HF's (C, N, S) -> (N, C, S)
        ok = (pos.dim() == 2 and tuple(pos.shape) == (n, s)) or (pos.dim() == 3 and pos.shape[0] == n
                                                                  and pos.shape[1] in (3, 4) and pos.shape[2] == s)
        if not ok:
            raise DataError(f"{self.path}: position_ids has shape {tuple(pos.shape)}; expected ({n}, {s}), "
                            f"({n}, 3|4, {s}) or (3|4, {n}, {s})")
        return pos.to(torch.int64).contiguous()

    def _labels(self, labels: torch.Tensor | None, shifted: bool) -> torch.Tensor:
        ignore = torch.full((self.n, 1), IGNORE_INDEX, dtype=torch.int64)
        if labels is None:
            labels = torch.cat([self.ids[:, 1:], ignore], dim=1)
            if self.mm is not None:  # a vision placeholder is never a target
                labels[:, :-1][self.mm[:, 1:] != 0] = IGNORE_INDEX
        else:
            labels = labels.to(torch.int64)
            if not shifted:
                labels = torch.cat([labels[:, 1:], ignore], dim=1)
        if self.attention_mask is not None:
            pad = self.attention_mask == 0
            labels = labels.masked_fill(pad, IGNORE_INDEX)
            labels[:, :-1] = labels[:, :-1].masked_fill(pad[:, 1:], IGNORE_INDEX)
        return labels.contiguous()

    def sample(self, r: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
        s = self.seq
        out: dict[str, torch.Tensor] = {"input_ids": self.ids[r], "labels": self.labels[r]}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids[r]
        if self.mm is not None and self.emit_mm:
            out["mm_token_type_ids"] = self.mm[r]
        if self.emit_mask:
            out["attention_mask"] = self.attention_mask[r].to(torch.int64)
        if s > seq_len:
            out = {k: v[..., :seq_len] for k, v in out.items()}
        elif s < seq_len:
            out = extend_tokens(out, seq_len - s, pad_id)
        out = {k: v.clone() for k, v in out.items()}
        for (pixels, grid), what in zip(VISION_KEYS, ("image", "video")):
            if grid not in self.vision:
                continue
            grids, first, offsets = self.vision[grid]
            a, b = int(first[r]), int(first[r + 1])
            if a == b:
                continue
            out[pixels] = self.tensors.rows(pixels, int(offsets[a]), int(offsets[b]))
            out[grid] = grids[a:b].clone()
        return out


def span_positions(mask: torch.Tensor) -> torch.Tensor:
    """(N, S) positions counting from 0 on every run of equal mask values (real tokens, padding)."""
    n, s = mask.shape
    idx = torch.arange(s).expand(n, s)
    edge = torch.ones_like(mask, dtype=torch.bool)
    edge[:, 1:] = mask[:, 1:] != mask[:, :-1]
    return (idx - torch.where(edge, idx, 0).cummax(1).values).contiguous()


def _vision_setting(ctx: DataContext, extra: dict, key: str, default: Any = None) -> Any:
    if extra.get(key) is not None:
        return extra[key]
    args = ctx.model_args
    for owner in (args, getattr(args, "vision", None), getattr(args, "vision_config", None)):
        value = owner.get(key) if isinstance(owner, dict) else getattr(owner, key, None)
        if value is not None:
            return value
    return default


class PresetSource:
    """Rows of one or more preset files; ``num_samples`` samples cycling over them by epoch."""

    def __init__(self, shards: list[_Shard], *, seq_len: int, num_samples: int, seed: int, shuffle: bool = False,
                 pad_id: int = 0, max_rows: int | None = None) -> None:
        self.shards = shards
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.pad_id = pad_id
        starts = [0]
        for sh in shards:
            starts.append(starts[-1] + sh.n)
        self._starts = starts
        self.rows = starts[-1] if max_rows is None else min(starts[-1], int(max_rows))
        if self.rows == 0:
            raise DataError("the preset data has no rows")
        self.order = EpochOrder(self.rows, seed, shuffle)
        self.is_vl = any(sh.is_vl for sh in shards)
        kinds = {1 if sh.position_ids.dim() == 2 else sh.position_ids.shape[1] for sh in shards if sh.position_ids is not None}
        if len(kinds) > 1:
            raise DataError(f"the preset files mix position_ids of {sorted(kinds)} rows")
        if self.is_vl:
            for sh in shards:
                sh.conform(next(iter(kinds), None))
            for sh in shards:
                if sh.seq > seq_len:
                    raise DataError(f"{sh.path}: rows of {sh.seq} tokens do not fit train.seq_len={seq_len} "
                                    "(VL rows are never truncated: that could cut an image)", hint=f"set train.seq_len={sh.seq}")
            self.collate = collate_vl
        if any(sh.attention_mask is not None or sh.seq < seq_len for sh in shards):
            for sh in shards:
                sh.pass_mask(vl_source=self.is_vl)
        if not self.is_vl:  # a micro-batch mixing rows with and without positions dropped the others'
            for sh in shards:
                sh.fill_positions(next(iter(kinds), None))

    def __len__(self) -> int:
        return self.num_samples

    def row(self, index: int) -> int:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return self.order(index)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        r = self.row(int(index))
        k = next(i for i in range(len(self.shards)) if r < self._starts[i + 1])
        return self.shards[k].sample(r - self._starts[k], self.seq_len, self.pad_id)


@register_dataset("preset", fields=("path", "shuffle", "max_samples"),
                  extra=("labels_shifted", "pad_token_id", "spatial_merge_size", "image_token_id", "video_token_id"))
def build_preset(options: dict, ctx: DataContext) -> PresetSource:
    extra = options.get("extra") or {}
    merge = int(_vision_setting(ctx, extra, "spatial_merge_size", 2))
    token_ids = {"image": _vision_setting(ctx, extra, "image_token_id"), "video": _vision_setting(ctx, extra, "video_token_id")}
    shards = [_Shard(p, labels_shifted=bool(extra.get("labels_shifted", True)), merge=merge, token_ids=token_ids)
              for p in preset_files(options.get("path"))]
    top = max(int(sh.ids.max()) for sh in shards if sh.ids.numel())
    if top >= ctx.vocab_size:
        raise DataError(f"the preset input_ids reach {top} but the model's vocabulary has {ctx.vocab_size} ids",
                        hint="the files were tokenized for another model")
    source = PresetSource(shards, seq_len=ctx.seq_len, num_samples=ctx.num_samples, seed=ctx.seed,
                          shuffle=bool(options.get("shuffle", False)), pad_id=int(extra.get("pad_token_id", 0)),
                          max_rows=options.get("max_samples"))
    log.info("data: %d preset rows from %d file(s)%s; the run reads %d samples", source.rows, len(shards),
             " (vision-language)" if source.is_vl else "", ctx.num_samples)
    if any(sh.seq > ctx.seq_len for sh in shards):
        log.warning("data: preset rows longer than train.seq_len=%d are truncated", ctx.seq_len)
    return source


__all__ = ["PresetSource", "build_preset", "preset_files"]
