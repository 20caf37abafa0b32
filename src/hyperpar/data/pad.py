"""Right-pad a micro-batch's rows to a multiple of the sequence split.

Context parallelism cuts every row into ``cp`` equal shards (``cp x tp`` with sequence parallelism)
and sequence parallelism alone into ``tp``. A ``train.seq_len`` that does not divide is padded here,
after the collate, so the model code never sees a ragged shard. The pads are neutral by
construction: they sit after the last real token (causal attention, the causal conv and the delta
rule never carry them backwards), their labels are ignored, ``attention_mask`` is 0 on them (the
router statistics leave them out and they form a document of their own) and their positions keep
counting past the row's last one.
"""

from __future__ import annotations

import torch

from hyperpar.data.hf import IGNORE_INDEX

# Per-token keys of a batch and the value a pad gets. position_ids is handled apart (counting on).
_FILL = {"input_ids": None, "labels": IGNORE_INDEX, "attention_mask": 0, "mm_token_type_ids": 0}


def pad_token_id(model_args) -> int:
    """The id the loader pads with: the text model's pad token, else 0 (a pad is never read)."""
    text = getattr(model_args, "text", model_args)
    pad = getattr(text, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def padded_length(seq_len: int, multiple: int) -> int:
    return -(-seq_len // multiple) * multiple


def extend_tokens(tensors: dict[str, torch.Tensor], extra: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Per-token tensors (keys of ``_FILL`` and ``position_ids``, tokens on the last dim, any leading
    dims: one sample's (S,) or a batch's (B, S), positions also (C, S) / (C, B, S)) with ``extra``
    pads appended: the fill value of each key, positions counting on past each row's last one."""
    out = {}
    for key, t in tensors.items():
        if key == "position_ids":  # never a target: only has to stay monotonic for causal kernels
            tail = t.amax(dim=-1, keepdim=True) + 1 + torch.arange(extra, device=t.device)
            out[key] = torch.cat([t, tail.to(t.dtype)], dim=-1)
        else:
            fill = pad_id if _FILL[key] is None else _FILL[key]
            out[key] = torch.cat([t, torch.full((*t.shape[:-1], extra), fill, dtype=t.dtype, device=t.device)], dim=-1)
    return out


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` with its (B, S) rows (and (B, S) / (C, B, S) positions) right-padded to a multiple of
    ``multiple``; an ``attention_mask`` is added (1 on the real tokens) when the batch has none.
    Other entries (vision patches and grids) are passed on as they are."""
    ids = batch["input_ids"]
    B, S = ids.shape
    extra = padded_length(S, multiple) - S
    if extra == 0:
        return batch
    out = dict(batch)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones(B, S, dtype=torch.long, device=ids.device)
    out.update(extend_tokens({k: out[k] for k in (*_FILL, "position_ids") if k in out}, extra, pad_id))
    return out
