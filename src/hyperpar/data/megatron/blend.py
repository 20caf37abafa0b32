"""Weighted blends of GPT corpora, with megatron-core's schedule or a bounded one.

A schedule says which corpus serves each blend sample. Two are available (``SCHEDULES``):

``"megatron"``: megatron-core's greedy rule, reproduced exactly: at step i (t = max(i, 1)) take the
corpus with the largest ``w_d * t - c_d``, lowest index on ties. A corpus is never more than a
sample ahead of its share, but with three or more corpora a light one can fall more than one sample
behind (1.33 samples in a four-corpus example pinned by the tests).

``"bounded"``: Tijdeman's chairman-assignment rule (see ``build_bounded_blending_indices``), which
keeps every corpus within ``1 - 1/(2k-2)`` samples (k corpora), so strictly less than one, of
``w_d * n`` at every prefix n of the stream.

A schedule depends only on its name, the weights and the size, never on the corpora, so it is
cached by those alone. Each corpus keeps its own GPT shuffle under either schedule.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np

from hyperpar.data.megatron.cache import IndexCache
from hyperpar.data.megatron.gpt import GPTDataset, GPTDatasetConfig, Split, as_split
from hyperpar.data.megatron.sampling import normalize
from hyperpar.errors import DataError

log = logging.getLogger(__name__)

_CACHE_FORMAT = "hyperpar.megatron.blend/1"
BlendSpec = Union[str, Sequence[Any]]

# relative slack on a release step of the bounded schedule: absorbs a few ulp of rounding, moves
# the bound by ~1e-14 * (samples of the corpus) at most
_SLACK = 1e-14

SCHEDULES = ("megatron", "bounded")
"""Blend schedules: megatron-core's order, or every corpus within one sample of its share."""


def check_schedule(schedule: str) -> str:
    """``schedule`` if it names a blend schedule, else a DataError listing them."""
    if schedule not in SCHEDULES:
        raise DataError(f"unknown blend schedule {schedule!r}", hint=f"use one of {', '.join(SCHEDULES)}")
    return schedule


# -- parsing ------------------------------------------------------------------------------------

def get_blend_from_list(words: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``["0.3", "a", "0.7", "b"]`` -> ``(["a", "b"], [0.3, 0.7])``; ``["a", "b"]`` -> ``(["a", "b"], None)``.

    Word pairs whose first words all parse as numbers are weighted; an odd count or no numbers
    means plain prefixes. Upstream half-accepts a mix of the two; here it is an error.
    """
    words = [str(w).strip() for w in words if str(w).strip()]
    if not words:
        raise DataError("empty data blend")
    if len(words) % 2 == 1:
        return words, None
    weights: list[float | None] = []
    for w in words[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return words, None
    if any(w is None for w in weights):
        raise DataError(f"ill-formed blend {' '.join(words)!r}: give 'weight prefix' pairs "
                        "or only prefixes")
    return words[1::2], [float(w) for w in weights]  # type: ignore[arg-type]


def is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def check_blend_prefixes(spec: BlendSpec) -> None:
    """``data.blend`` as a user writes it: a number where a corpus prefix belongs is a mistake ("0.3 0.7",
    or an odd word count that upstream reads as all prefixes), not a corpus named "0.7" to fail on later
    as "0.7.idx not found". ``parse_blend`` itself keeps megatron's reading."""
    prefixes, _ = parse_blend(spec)
    for p in prefixes:
        if is_number(p):
            raise DataError(f"data.blend {spec if isinstance(spec, str) else list(spec)!r}: {p!r} stands where a corpus prefix is expected",
                            hint="give 'weight prefix' pairs, e.g. '0.3 /data/wiki 0.7 /data/code' (a numeric path: write ./0.7)")


def parse_blend(spec: BlendSpec) -> tuple[list[str], list[float] | None]:
    """A blend string ``"0.3 /a 0.7 /b"``, a word list, or a list of ``{weight, prefix}`` mappings."""
    if isinstance(spec, str):
        prefixes, weights = get_blend_from_list(spec.split())
    elif spec and all(isinstance(e, Mapping) for e in spec):
        try:
            prefixes = [str(e["prefix"]) for e in spec]
            weights = [float(e["weight"]) for e in spec] if any("weight" in e for e in spec) else None
        except KeyError as e:
            raise DataError(f"blend entry without {e.args[0]!r}: each needs prefix (and weight)") from None
        except (TypeError, ValueError) as e:
            raise DataError(f"blend weight is not a number: {e}") from None
    else:
        prefixes, weights = get_blend_from_list([str(w) for w in spec])
    if weights is not None:
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"blend weights {weights} must be finite, non-negative, with a positive sum")
        if any(w == 0 for w in weights):
            raise DataError(f"blend weight 0 for {prefixes[weights.index(0)]}", hint="drop the corpus instead")
    return prefixes, weights


# -- schedules ----------------------------------------------------------------------------------

def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)`` of length ``size``, greedy by largest error.

    A plain Python loop: the rule is inherently sequential (no closed form reproduces its float
    comparisons and ties), and it runs once per blend at roughly 1 µs per step, then is cached.
    """
    w = [float(x) for x in weights]
    order = _greedy(w, size, [None] * len(w))
    return _with_sample_index(order, len(w))


def build_exhaustive_blending_indices(sizes: Sequence[int], schedule: str = "megatron"
                                      ) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every corpus once, in proportion to ``sizes``.

    ``"megatron"``: upstream's greedy, where a corpus drops out when spent. ``"bounded"``: the
    bounded schedule over ``sum(sizes)`` steps; its bound (< 1 sample) at the last step forces each
    corpus's count to equal its size, so nothing needs to drop out.
    """
    check_schedule(schedule)
    total = int(sum(int(n) for n in sizes))
    if schedule == "bounded":
        order, sample = build_bounded_blending_indices([int(n) for n in sizes], total)
        counts = np.bincount(order.astype(np.int64), minlength=len(sizes))
        if counts.tolist() != [int(n) for n in sizes]:  # unreachable unless float rounding defeats the bound
            raise DataError(f"bounded exhaustive blend took {counts.tolist()} samples, not {list(sizes)}")
        return order, sample
    w = [int(n) / float(total) for n in sizes]
    order = _greedy(w, total, [int(n) for n in sizes])
    return _with_sample_index(order, len(w))


def build_bounded_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index int16, dataset_sample_index int64)``: every prefix within one sample of the weights.

    With ``w`` the weights normalised to sum 1, ``k`` corpora and ``c_d(n)`` the samples corpus d
    has among the first n, every prefix n satisfies ``|c_d(n) - w_d * n| <= 1 - 1/(2k-2) < 1``
    (k >= 2; one corpus is trivially exact). This is Tijdeman's algorithm for the chairman
    assignment problem (R. Tijdeman, Discrete Math. 32 (1980) 323-330), with ``s = 1 - 1/(2k-2)``:

    * the (c+1)-th sample of corpus d is *released* at the first step n with ``c + 1 - s <= w_d n``
      (taking it then keeps ``c_d(n) - w_d n <= s``: never a sample ahead);
    * its *deadline* is ``(c + s) / w_d``: past it, ``c_d(n) < w_d n - s`` (a sample behind);
    * step n takes, among the released corpora, the one with the earliest deadline (lowest index
      on ties): earliest-deadline-first over these windows.

    A released corpus always exists: the lags ``w_d n - c_d(n-1)`` sum to 1, so the largest is
    at least ``1/k >= 1/(2k-2) = 1 - s``. Tijdeman proves no deadline is ever missed, which is the
    lower half of the bound. Both halves are checked at every prefix by a hypothesis test.

    Deterministic (the same weights and size give the same order on every machine: plain IEEE
    float64 arithmetic) and independent of the corpora. Two heaps of at most k corpora: O(log k)
    per sample, under 1 us per sample for a handful of corpora (the megatron loop's speed); cached
    by the caller.
    """
    w = _positive_weights(weights)
    k = len(w)
    if size < 0:
        raise DataError(f"a blend size must be >= 0, got {size}")
    if k == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    s = 1.0 - 1.0 / (2 * k - 2)

    def release(c: int, wd: float) -> float:
        # the (c+1)-th sample of a corpus of weight wd may go at step n iff release(c, wd) <= n; the
        # relative slack only absorbs a few ulp of rounding in the division, so that an exactly
        # integral release is not pushed one step late
        x = (c + 1 - s) / wd
        return x - _SLACK * (1.0 + x)

    counts = [0] * k
    ready: list[tuple[float, int]] = []    # (deadline, corpus): the corpora whose next sample is released
    waiting: list[tuple[int, int]] = []    # (release step, corpus): the others
    for d in range(k):
        if release(0, w[d]) <= 1:
            ready.append((s / w[d], d))
        else:
            waiting.append((math.ceil(release(0, w[d])), d))
    heapq.heapify(ready)
    heapq.heapify(waiting)
    push, pop, ceil = heapq.heappush, heapq.heappop, math.ceil
    never = size + 2
    due = waiting[0][0] if waiting else never  # the earliest release step in ``waiting``
    order = [0] * size
    sample = [0] * size
    for n in range(1, size + 1):
        if due <= n:
            while waiting and waiting[0][0] <= n:
                d = pop(waiting)[1]
                push(ready, ((counts[d] + s) / w[d], d))
            due = waiting[0][0] if waiting else never
        # in exact arithmetic ``ready`` is never empty here; should rounding ever empty it, take
        # the corpus released soonest
        d = pop(ready)[1] if ready else pop(waiting)[1]
        c = counts[d]
        order[n - 1] = d
        sample[n - 1] = c
        c += 1
        counts[d] = c
        wd = w[d]
        r = (c + 1 - s) / wd
        r -= _SLACK * (1.0 + r)  # release(c, wd), inlined: this loop is the whole cost
        if r <= n + 1:
            push(ready, ((c + s) / wd, d))
        else:
            r = ceil(r)
            push(waiting, (r, d))
            if r < due:
                due = r
    return np.array(order, dtype=np.int16), np.array(sample, dtype=np.int64)


def _positive_weights(weights: Sequence[float]) -> list[float]:
    """Finite positive weights normalised to sum 1 (a zero weight is an error: drop the corpus)."""
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.size == 0:
        raise DataError("a blend needs at least one weight")
    if w.size >= 32767:
        raise DataError(f"a blend holds at most 32766 corpora, got {w.size}")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"blend weights {w.tolist()} must be finite and positive", hint="drop a corpus of weight 0")
    return (w / w.sum()).tolist()


def _greedy(w: list[float], size: int, caps: list[int | None]) -> np.ndarray:
    counts = [0] * len(w)
    live = [d for d in range(len(w)) if caps[d] is None or caps[d] > 0]
    out = np.empty(size, dtype=np.int16)
    for i in range(size):
        t = float(i) if i > 1 else 1.0
        best = live[0]
        best_err = w[best] * t - counts[best]
        for d in live[1:]:
            err = w[d] * t - counts[d]
            if err > best_err:  # strict: the lowest index wins ties, as upstream
                best, best_err = d, err
        out[i] = best
        counts[best] += 1
        if counts[best] == caps[best]:
            live.remove(best)
    return out


def _with_sample_index(order: np.ndarray, num_datasets: int) -> tuple[np.ndarray, np.ndarray]:
    sample = np.empty(order.shape[0], dtype=np.int64)
    for d in range(num_datasets):
        hits = order == d
        sample[hits] = np.arange(int(hits.sum()), dtype=np.int64)
    return order, sample


# -- datasets -----------------------------------------------------------------------------------

class BlendedDataset:
    """Sample ``i`` is sample ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]``.

    ``weights`` are floats normalised here when ``size`` is given; with ``size=None`` they are the
    integer sample counts to take exhaustively from each corpus. ``schedule`` is ``"megatron"``
    (megatron-core's order, the default here) or ``"bounded"`` (see ``build_bounded_blending_indices``).
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float | int], size: int | None,
                 config: GPTDatasetConfig, schedule: str = "megatron") -> None:
        if not datasets or len(datasets) != len(weights):
            raise DataError("a blend needs one weight per corpus")
        if len(datasets) >= 32767:
            raise DataError(f"a blend holds at most 32766 corpora, got {len(datasets)}")
        if any(w <= 0 for w in weights):
            empty = [ds.dataset_path for ds, w in zip(datasets, weights) if w <= 0]
            raise DataError(f"blend corpus {empty[0]} has weight or size 0")
        self.schedule = check_schedule(schedule)
        self.datasets = list(datasets)
        self.split = self.datasets[0].index_split
        self.size = size
        self.config = config
        self.weights: list[Any] = normalize(list(weights)) if size is not None else [int(w) for w in weights]
        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._check_capacity()

    def _cache(self) -> IndexCache:
        key = {"class": "BlendedDataset", "format": _CACHE_FORMAT, "schedule": self.schedule,
               "weights": self.weights, "size": self.size}
        info = {"datasets": [os.path.abspath(ds.dataset_path) for ds in self.datasets],
                "split": self.split.name}
        explicit = self.config.path_to_cache is not None
        if explicit:
            directory: str | None = self.config.path_to_cache
        else:  # megatron has no default blend cache; next to the first corpus's GPT cache is ours
            first = self.datasets[0].cache_dir
            directory = os.path.join(os.path.dirname(first), "BlendedDataset_indices") if first else None
        return IndexCache(directory, "BlendedDataset", self.split.name, key, info, explicit)

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray]:
        cache = self._cache()
        names = ["dataset_index", "dataset_sample_index"]
        hit = cache.load(names)
        if hit is not None and hit["dataset_index"].shape == hit["dataset_sample_index"].shape:
            return hit["dataset_index"], hit["dataset_sample_index"]
        t0 = time.perf_counter()
        if self.size is None:
            arrays = build_exhaustive_blending_indices(self.weights, self.schedule)
        elif self.schedule == "bounded":
            arrays = build_bounded_blending_indices(self.weights, self.size)
        else:
            arrays = build_blending_indices(self.weights, self.size)
        log.info("built %s blend indices (%d samples, %d corpora) in %.2fs", self.schedule,
                 arrays[0].shape[0], len(self.datasets), time.perf_counter() - t0)
        cache.save(dict(zip(names, arrays)))
        return arrays

    def _check_capacity(self) -> None:
        used = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, used.tolist())):
            if n > len(ds):
                raise DataError(f"the {self.split.name} blend takes {n} samples from corpus {d} "
                                f"({ds.dataset_path}), which has {len(ds)}",
                                hint="raise mid_level_dataset_surplus")

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def locate(self, idx: int) -> tuple[int, int]:
        """``(corpus, sample within that corpus)`` of blend sample ``idx``."""
        return int(self.dataset_index[idx]), int(self.dataset_sample_index[idx])

    def sample(self, idx: int) -> dict[str, Any]:
        d, j = self.locate(idx)
        return {"dataset_id": d, **self.datasets[d].sample(j)}

    def __getitem__(self, idx: int) -> dict[str, Any]:
        d, j = self.locate(idx)
        return {"dataset_id": d, **self.datasets[d][j]}


def _sizes_for(weights: list[float], size: int, surplus: float) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def build_gpt_dataset(blend: BlendSpec | tuple[list[str], list[float] | None], num_samples: int | None,
                      config: GPTDatasetConfig, index_split: Split | str = Split.train,
                      schedule: str = "megatron") -> GPTDataset | BlendedDataset:
    """One split of what megatron-core's BlendedMegatronDatasetBuilder builds for ``blend``.

    One unweighted prefix (or one weighted prefix with ``config.split=None``) -> a GPTDataset of
    ``num_samples``. Weights and a size -> each corpus
    asks for ``ceil(ceil(N * w) * (1 + surplus))`` samples and the blend has ``sum(ceil(N * w))``.
    No weights -> one epoch per corpus, weighted by length, ``min(N, total)`` samples (all of them,
    exhaustively, when N is None). ``schedule`` picks the blend schedule (``SCHEDULES``); the
    sizes are the same under both.
    """
    check_schedule(schedule)
    split = as_split(index_split)
    if isinstance(blend, tuple) and len(blend) == 2 and isinstance(blend[0], list):
        prefixes, weights = blend[0], blend[1]
    else:
        prefixes, weights = parse_blend(blend)  # type: ignore[arg-type]
    if weights is not None:
        weights = normalize(weights)

    # Upstream builds a 1-way blend for a weighted single prefix only under --data-path (a split
    # string); per-split paths (our split=None: every sequence) always give a plain dataset.
    if len(prefixes) == 1 and (weights is None or config.split is None):
        return GPTDataset.from_prefix(prefixes[0], config, num_samples, split)

    if weights is not None:
        if num_samples is None:
            raise DataError("a weighted blend needs a sample count", hint="set num_samples")
        target = _sizes_for(weights, num_samples, 0.0)
        buffer = _sizes_for(weights, num_samples, config.mid_level_dataset_surplus)
        datasets = [GPTDataset.from_prefix(p, config, n, split) for p, n in zip(prefixes, buffer)]
        return BlendedDataset(datasets, weights, sum(target), config, schedule)

    datasets = [GPTDataset.from_prefix(p, config, None, split) for p in prefixes]
    lengths = [len(ds) for ds in datasets]
    if num_samples is None:
        return BlendedDataset(datasets, lengths, None, config, schedule)
    return BlendedDataset(datasets, lengths, min(num_samples, sum(lengths)), config, schedule)

