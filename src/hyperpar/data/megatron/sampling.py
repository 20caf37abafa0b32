"""The three GPT indices, built exactly as megatron-core builds them so the sample order matches.

document index: which sequence (by id) comes at each position of the shuffled multi-epoch stream;
sample index: ``(position, token offset)`` where each sample starts, one row per sample plus one;
shuffle index: the order in which samples are served.

All randomness is one ``numpy.random.RandomState(seed)`` consumed in a fixed order (document
shuffles, then sample shuffles). The sample index is computed in closed form with numpy instead of
megatron-core's per-sample C++ walk; the result is identical (checked against it).
"""

from __future__ import annotations

import re

import numpy as np

from hyperpar.errors import DataError

# megatron-core separates the last epoch when it would contribute fewer than 80% of an epoch's
# samples, so that thin epoch is not smeared over the whole run.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def normalize(weights: list[float]) -> list[float]:
    """``w / sum(w)`` in float64 via numpy, the exact arithmetic megatron-core uses."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_and_normalize_split(split: str) -> list[float]:
    """``"969, 30, 1"`` -> normalised train/valid/test fractions (missing entries are 0)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if len(parts) > 3 or not parts or sum(parts) <= 0:
        raise DataError(f"split {split!r} must give 1 to 3 non-negative numbers with a positive sum")
    return normalize(parts + [0.0] * (3 - len(parts)))


def split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """Fractions -> ``[(begin, end) or None]`` bookends; the first begin is the integer 0 (as upstream)."""
    bookends: list[float] = [0]
    for p in vector:
        bookends.append(bookends[-1] + p)
    return [(a, b) if b > a else None for a, b in zip(bookends[:-1], bookends[1:])]


def split_range(bookend: tuple[float, float], num_sequences: int) -> tuple[int, int]:
    """Contiguous sequence ids of one split; Python ``round`` (half to even) as upstream."""
    return int(round(bookend[0] * float(num_sequences))), int(round(bookend[1] * float(num_sequences)))


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_len: int, extra: int) -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_len + extra."""
    if num_samples is None:
        return 1
    need = num_samples * seq_len + extra
    return max(1, -(-need // tokens_per_epoch))


def plan_epochs(tokens_per_epoch: int, num_samples: int | None, seq_len: int, extra: int
                ) -> tuple[int, bool, int]:
    """``(epochs, separate_final_epoch, samples served by the epochs before the last)``."""
    if tokens_per_epoch <= 1:
        raise DataError(f"the selected sequences hold {tokens_per_epoch} token(s); a GPT sample "
                        f"needs {seq_len + extra}", hint="check the corpus and the split")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_len, extra)
    if epochs == 1 or num_samples is None:
        return epochs, False, 0
    sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_len
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - extra) // seq_len
    return epochs, from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), sans_final


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """``documents`` repeated epoch-major and shuffled (the last epoch on its own when separate)."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_len: int,
                       tokens_per_epoch: int, epochs: int, drop_last_partial: bool = True,
                       extra: int = 1) -> np.ndarray:
    """Rows ``(position in document_index, token offset)`` where each sample starts, N + 1 rows.

    Sample k covers global tokens ``[k*L, k*L + L + extra)`` of the concatenated stream. Its start
    row names the sequence holding token ``k*L + extra - 1`` (the last token of the previous
    sample's walk: that is where megatron's walk stops), so a start can sit at the end of a
    sequence when ``extra == 0``, and zero-length sequences never own a row.
    """
    if seq_len <= 1:
        raise DataError(f"sequence length must be > 1, got {seq_len}")
    total = epochs * tokens_per_epoch
    if drop_last_partial:
        n = (total - extra) // seq_len
    else:
        # upstream divides in single precision; keep that so N matches for huge corpora too
        n = int(np.ceil(np.float32(total - extra) / np.float32(seq_len)))
    positions = len(document_index)
    wide = max(positions, int(sequence_lengths.max())) > np.iinfo(np.int32).max
    rows = np.zeros((n + 1, 2), dtype=np.int64 if wide else np.int32)
    if n == 0:
        return rows
    ends = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    np.cumsum(ends, out=ends)  # in place: one int64 per position, however many epochs
    k = np.arange(1, n + 1, dtype=np.int64)
    owner = np.searchsorted(ends, k * seq_len + extra - 1, side="right")
    # Only a final partial sample (drop_last_partial=False) runs past the stream; upstream pins its
    # end row to the last position at offset length - extra.
    past = owner >= positions
    owner = np.minimum(owner, positions - 1)
    starts = np.where(owner > 0, ends[np.maximum(owner - 1, 0)], 0)
    offset = k * seq_len - starts
    offset[past] = int(sequence_lengths[document_index[-1]]) - extra
    rows[1:, 0] = owner
    rows[1:, 1] = offset
    return rows


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``arange(num_samples)`` shuffled, then ``arange(num_samples, total_size)`` shuffled apart."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, sequence_ids: np.ndarray, num_samples: int | None,
                      seq_len: int, seed: int, extra: int = 1, drop_last_partial: bool = True
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(document_index, sample_index, shuffle_index)`` for the sequences ``sequence_ids``."""
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[sequence_ids], dtype=np.int64))
    epochs, separate, sans_final = plan_epochs(tokens_per_epoch, num_samples, seq_len, extra)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(sequence_ids, epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_len, tokens_per_epoch,
                                      epochs, drop_last_partial, extra)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index
