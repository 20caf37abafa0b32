"""GPTDataset: fixed ``seq_len + 1`` token windows over the shuffled sequences of a Megatron corpus.

Same constructor, indices and sample order as megatron-core's ``GPTDataset``; sample ``i`` is a
pure function of ``i`` (the indices are built once, then only read).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyperpar.data.megatron.cache import IndexCache, array_fingerprint, file_fingerprint
from hyperpar.data.megatron.indexed import IndexedDataset, get_idx_path
from hyperpar.data.megatron.sampling import (
    build_gpt_indices,
    parse_and_normalize_split,
    split_matrix,
    split_range,
)
from hyperpar.errors import DataError

log = logging.getLogger(__name__)

_CACHE_FORMAT = "hyperpar.megatron.gpt/1"
_INDEX_NAMES = ["document_index", "sample_index", "shuffle_index"]


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


def as_split(split: Split | str) -> Split:
    if isinstance(split, Split):
        return split
    try:
        return Split[str(split)]
    except KeyError:
        raise DataError(f"unknown split {split!r}", hint="one of train, valid, test") from None


@dataclass
class GPTDatasetConfig:
    """megatron-core's GPTDatasetConfig fields that shape samples, plus explicit token ids.

    ``eod_token_id`` / ``pad_token_id`` replace megatron's ``tokenizer.eod`` / ``tokenizer.pad``;
    a ``tokenizer`` with those attributes is accepted too. ``create_attention_mask`` defaults to
    False here (upstream: True) because an L x L mask per sample dominates reading time.
    """

    random_seed: int
    sequence_length: int
    blend: tuple[list[str], list[float] | None] | None = None
    split: str | None = None
    path_to_cache: str | None = None
    mid_level_dataset_surplus: float = 0.005
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    eod_token_id: int | None = None
    pad_token_id: int | None = None
    allow_ambiguous_pad_tokens: bool = False
    tokenizer: Any = None
    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            if self.eod_token_id is None:
                self.eod_token_id = getattr(self.tokenizer, "eod", None)
            if self.pad_token_id is None:
                self.pad_token_id = getattr(self.tokenizer, "pad", None)
        if self.sequence_length <= 1:
            raise DataError(f"sequence length must be > 1, got {self.sequence_length}")
        if self.split is not None:
            self.split_matrix = split_matrix(parse_and_normalize_split(self.split))
        needs_eod = self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask
        if needs_eod and self.eod_token_id is None:
            raise DataError("eod_mask_loss / reset_position_ids / reset_attention_mask need the "
                            "end-of-document token id", hint="set eod_token_id")

    @property
    def pad_id(self) -> int:
        """Padding id for a short final sample: the tokenizer's pad unless it collides with eod, else -1."""
        pad = self.pad_token_id
        if pad is None or (pad == self.eod_token_id and not self.allow_ambiguous_pad_tokens):
            return -1
        return int(pad)


def ltor_masks_and_position_ids(tokens: np.ndarray, eod: int | None, reset_position_ids: bool,
                                reset_attention_mask: bool, eod_mask_loss: bool,
                                create_attention_mask: bool
                                ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(attention_mask [1,L,L] True = masked | None, loss_mask float32, position_ids int64)``."""
    length = tokens.shape[0]
    positions = np.arange(length, dtype=np.int64)
    loss_mask = np.ones(length, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0  # the eod *input* position, as upstream
    start = None
    if reset_position_ids or reset_attention_mask:
        # start[t] = first position of the document part holding t (just after the last eod < t)
        after = np.flatnonzero(tokens == eod) + 1
        after = after[after < length]
        start = np.zeros(length, dtype=np.int64)
        start[after] = after
        np.maximum.accumulate(start, out=start)
    position_ids = positions - start if (reset_position_ids and start is not None) else positions
    attention_mask = None
    if create_attention_mask:
        allowed = positions[None, :] <= positions[:, None]
        if reset_attention_mask and start is not None:
            allowed &= positions[None, :] >= start[:, None]
        attention_mask = ~allowed[None]
    return attention_mask, loss_mask, position_ids


class GPTDataset:
    """megatron-core-compatible GPT dataset over one IndexedDataset.

    ``GPTDataset(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)``
    as upstream; ``indexed_indices=None`` means every sequence. ``len()`` covers whole epochs, so
    it is at least ``num_samples``. ``ds[i]`` returns torch tensors, ``ds.sample(i)`` numpy arrays.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str | None,
                 indexed_indices: np.ndarray | None, num_samples: int | None,
                 index_split: Split | str, config: GPTDatasetConfig) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path if dataset_path is not None else indexed_dataset.path_prefix
        if indexed_indices is None:
            indexed_indices = np.arange(len(indexed_dataset), dtype=np.int32)
        self.indices = np.asarray(indexed_indices, dtype=np.int32)
        self.num_samples = num_samples
        self.index_split = as_split(index_split)
        self.config = config
        self._extra = int(config.add_extra_token_to_sequence)
        self._pad = config.pad_id
        self.cache_dir: str | None = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_indices()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_prefix(cls, path_prefix: str, config: GPTDatasetConfig, num_samples: int | None = None,
                    index_split: Split | str = Split.train) -> GPTDataset:
        """Open ``path_prefix`` and take the sequences ``config.split`` assigns to ``index_split``."""
        dataset = cls.build_low_level_dataset(path_prefix, config)
        split = as_split(index_split)
        indices = None
        if config.split_matrix is not None:
            bookend = config.split_matrix[split.value]
            if bookend is None:
                raise DataError(f"split {config.split!r} gives the {split.name} split no data")
            beg, end = split_range(bookend, cls.numel_low_level_dataset(dataset))
            indices = np.arange(beg, end, dtype=np.int32)
        return cls(dataset, path_prefix, indices, num_samples, split, config)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return len(low_level_dataset)

    @property
    def _drop_last_partial(self) -> bool:
        """Only a validation split may keep a final short sample (upstream's rule)."""
        return self.index_split != Split.valid or self.config.drop_last_partial_validation_sequence

    def _cache(self) -> IndexCache:
        key = {
            "class": "GPTDataset",
            "format": _CACHE_FORMAT,
            "corpus_index_blake2b": file_fingerprint(get_idx_path(self.dataset.path_prefix)),
            "sequences": [len(self.indices), array_fingerprint(self.indices)],
            "num_samples": self.num_samples,
            "index_split": self.index_split.name,
            "random_seed": self.config.random_seed,
            "sequence_length": self.config.sequence_length,
            "add_extra_token_to_sequence": bool(self._extra),
            "drop_last_partial_sequence": self._drop_last_partial,
        }
        info = {"dataset_path": os.path.abspath(self.dataset_path), "split": self.config.split}
        explicit = self.config.path_to_cache is not None
        directory = (self.config.path_to_cache if explicit
                     else os.path.join(self.dataset_path, "cache", "GPTDataset_indices"))
        return IndexCache(directory, "GPTDataset", self.index_split.name, key, info, explicit)

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cache = self._cache()
        hit = cache.load(_INDEX_NAMES)
        if hit is not None and _consistent(hit):
            self.cache_dir = cache.directory
            return hit["document_index"], hit["sample_index"], hit["shuffle_index"]
        t0 = time.perf_counter()
        arrays = build_gpt_indices(self.dataset.sequence_lengths, self.indices, self.num_samples,
                                   self.config.sequence_length, self.config.random_seed,
                                   self._extra, self._drop_last_partial)
        log.info("built GPT indices for %s (%s, %d samples) in %.2fs", self.dataset_path,
                 self.index_split.name, arrays[1].shape[0] - 1, time.perf_counter() - t0)
        if cache.save(dict(zip(_INDEX_NAMES, arrays))):
            self.cache_dir = cache.directory
        return arrays

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def text(self, idx: int) -> np.ndarray:
        """The ``seq_len + extra`` int64 token ids of sample ``idx`` (short final samples padded)."""
        j = int(self.shuffle_index[idx])
        p0, o0 = (int(v) for v in self.sample_index[j])
        p1, o1 = (int(v) for v in self.sample_index[j + 1])
        tokens, itemsize = self.dataset.tokens, self.dataset.dtype.itemsize
        seqs = self.document_index[p0:p1 + 1]
        if p0 == p1:
            s = int(self.dataset.sequence_pointers[seqs[0]]) // itemsize
            parts = [tokens[s + o0:s + o1 + self._extra]]
        else:
            begin = self.dataset.sequence_pointers[seqs] // itemsize
            end = begin + self.dataset.sequence_lengths[seqs]
            end[-1] = begin[-1] + o1 + self._extra
            begin[0] += o0
            parts = [tokens[a:b] for a, b in zip(begin.tolist(), end.tolist())]
        text = np.concatenate(parts, dtype=np.int64)
        want = self.config.sequence_length + self._extra
        if text.shape[0] < want:
            text = np.concatenate([text, np.full(want - text.shape[0], self._pad, dtype=np.int64)])
        return text

    def sample(self, idx: int | None) -> dict[str, np.ndarray]:
        """The sample dict as numpy arrays; ``idx=None`` is sample 0 with no loss (batch padding)."""
        cfg = self.config
        text = self.text(0 if idx is None else idx)
        if self._extra:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.empty_like(text)
            labels[:-1] = text[1:]
            labels[-1] = self._pad
        attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
            tokens, cfg.eod_token_id, cfg.reset_position_ids, cfg.reset_attention_mask,
            cfg.eod_mask_loss, cfg.create_attention_mask)
        loss_mask[labels == self._pad] = 0.0
        tokens[tokens == self._pad] = 0  # pad may be -1: keep every id embeddable
        labels[labels == self._pad] = 0
        if idx is None:
            loss_mask[:] = 0.0
        out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        return out

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self.sample(idx).items()}

    def __repr__(self) -> str:
        return (f"GPTDataset({self.dataset_path!r}, split={self.index_split.name}, "
                f"samples={len(self)}, seq_len={self.config.sequence_length})")


def _consistent(arrays: dict[str, np.ndarray]) -> bool:
    """Shapes agree (guards against a cache someone edited or truncated by hand)."""
    doc, rows, shuffle = arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]
    return (doc.ndim == 1 and rows.ndim == 2 and rows.shape[1] == 2 and shuffle.ndim == 1
            and shuffle.shape[0] == rows.shape[0] - 1)
