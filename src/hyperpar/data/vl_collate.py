"""Collate vision-language samples into one micro-batch in Hugging Face's Qwen-VL layout.

Per sample: ``input_ids``/``labels``/``mm_token_type_ids`` (S,), ``position_ids`` (S,) or (C, S)
with C = 3 (T, H, W) or 4 (text row first), and for each image or video it holds its patch rows
``pixel_values`` (P_i, D) / ``pixel_values_videos`` with one grid row each in ``image_grid_thw`` /
``video_grid_thw`` (n_i, 3). The batch stacks the per-token tensors to (B, S), puts multi-row
positions in HF's (C, B, S) order, and concatenates patch rows and grids in sample order, which is
the order the vision tower and the placeholder scatter consume them. A modality no sample of the
micro-batch has is left out of the batch.
"""

from __future__ import annotations

import torch

VISION_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
_CONCAT = {k for pair in VISION_KEYS for k in pair}


def collate_vl(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    keys = list(dict.fromkeys(k for s in samples for k in s))
    for key in keys:
        if key in _CONCAT:
            continue
        missing = [i for i, s in enumerate(samples) if key not in s]
        if missing:
            raise ValueError(f"samples {missing} of the micro-batch have no {key!r}")
        values = [s[key] for s in samples]
        if key == "position_ids" and values[0].dim() == 2:
            out[key] = torch.stack(values, dim=1)  # (C, S) each -> (C, B, S)
        else:
            out[key] = torch.stack(values)
    for pixels, grid in VISION_KEYS:
        have = [s for s in samples if s.get(grid) is not None and s[grid].shape[0] > 0]
        if have:
            out[pixels] = torch.cat([s[pixels] for s in have])
            out[grid] = torch.cat([s[grid] for s in have])
    return out
