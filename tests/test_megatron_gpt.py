"""GPT sampling over Megatron corpora: megatron-core's order, contiguity, masks, caching."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import hyperpar.data.megatron.gpt as gpt_module
from hyperpar.data.megatron import GPTDataset, GPTDatasetConfig, IndexedDatasetBuilder, MegatronSource
from hyperpar.errors import DataError

EOD = 0


def write_counter_corpus(prefix: Path, lengths: list[int], start: int = 1, dtype=np.uint16) -> str:
    """Sequence i holds the next ``lengths[i]`` values of a running counter: every token is unique,
    so a sample's provenance can be read off its values."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    nxt = start
    for n in lengths:
        builder.add_item(np.arange(nxt, nxt + n))
        builder.end_document()
        nxt += n
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


GOLDEN_LENGTHS = [(i * 7) % 11 for i in range(30)]  # includes zero-length sequences

# Produced by megatron-core 0.16.1's GPTDataset on the same corpus (train split = all sequences,
# blend_per_split, pad -1). Keys: (seq_len, seed, num_samples, add_extra_token, split, drop_last).
GOLDEN = {
    (8, 1234, None, True, "train", True): dict(
        n=18, ndoc=30, doc=[7, 10, 4, 1, 28, 8, 3, 23, 14, 13, 22, 24, 0, 2, 27, 26, 18, 5, 16, 25],
        rows=[[0, 0], [1, 3], [3, 1], [4, 2], [6, 0], [6, 8], [7, 6], [8, 7]],
        shuffle=[6, 0, 5, 16, 8, 9, 17, 4, 7, 13, 15, 10, 14, 3, 11, 1, 12, 2], tail=[3, 11, 1, 12, 2],
        tokens3=[59, 60, 61, 62, 107, 108, 109, 110], labels3=[60, 61, 62, 107, 108, 109, 110, 29]),
    # six epochs, the thin last one separated (its samples stay at the end of the shuffle)
    (8, 1234, 100, True, "train", True): dict(
        n=113, ndoc=180, doc=[1, 3, 13, 6, 29, 29, 27, 5, 9, 2, 22, 12, 27, 1, 13, 19, 10, 25, 18, 4],
        rows=[[0, 0], [1, 1], [1, 9], [3, 4], [4, 3], [6, 1], [8, 5], [11, 2]],
        shuffle=[12, 84, 45, 6, 34, 64, 16, 31, 25, 10, 0, 46, 52, 28, 74, 11, 15, 21, 22, 88],
        tail=[108, 95, 100, 110, 94],
        tokens3=[49, 50, 51, 8, 9, 10, 56, 57], labels3=[50, 51, 8, 9, 10, 56, 57, 58]),
    # two epochs mixed in one shuffle (the last epoch is not thin enough to separate)
    (8, 7, 33, True, "train", True): dict(
        n=37, ndoc=60, doc=[1, 20, 29, 17, 10, 14, 4, 15, 21, 0, 7, 15, 12, 13, 27, 18, 2, 1, 16, 5],
        rows=[[0, 0], [1, 1], [2, 1], [3, 4], [4, 3], [5, 7], [6, 5], [8, 1]],
        shuffle=[22, 28, 6, 16, 7, 10, 8, 26, 30, 21, 14, 24, 23, 13, 12, 0, 15, 11, 35, 20],
        tail=[19, 36, 27, 3, 33],
        tokens3=[29, 30, 31, 32, 33, 34, 35, 36], labels3=[30, 31, 32, 33, 34, 35, 36, 37]),
    (8, 1234, 40, False, "train", True): dict(
        n=57, ndoc=90, doc=[29, 15, 8, 22, 6, 24, 9, 13, 18, 1, 21, 3, 4, 20, 16, 27, 21, 20, 10, 7],
        rows=[[0, 0], [1, 3], [4, 4], [5, 3], [6, 8], [8, 5], [10, 1], [11, 5]],
        shuffle=[16, 2, 24, 6, 13, 11, 8, 10, 29, 27, 15, 22, 5, 12, 3, 36, 31, 19, 30, 9],
        tail=[40, 46, 53, 47, 55],
        tokens3=[108, 109, 110, 11, 12, 13, 14, 15], labels3=[109, 110, 11, 12, 13, 14, 15, 0]),
    # validation keeping the final partial sample (N = ceil)
    (8, 99, None, True, "valid", False): dict(
        n=19, ndoc=30, doc=[23, 24, 16, 12, 21, 27, 10, 15, 2, 7, 22, 14, 6, 11, 13, 0, 19, 17, 28, 29],
        rows=[[0, 0], [1, 1], [3, 4], [5, 1], [7, 3], [9, 2], [11, 5], [12, 3]],
        shuffle=[6, 8, 12, 2, 18, 3, 10, 13, 0, 16, 1, 9, 4, 5, 14, 11, 17, 15, 7],
        tail=[14, 11, 17, 15, 7],
        tokens3=[60, 61, 62, 107, 108, 109, 110, 137], labels3=[61, 62, 107, 108, 109, 110, 137, 138]),
}


@pytest.fixture(scope="module")
def golden_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_counter_corpus(tmp_path_factory.mktemp("golden") / "c", GOLDEN_LENGTHS)


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"L{k[0]}-seed{k[1]}-N{k[2]}-x{int(k[3])}-{k[4]}")
def test_matches_megatron_core(golden_corpus: str, tmp_path: Path, key) -> None:
    seq_len, seed, num_samples, extra, split, drop_last = key
    want = GOLDEN[key]
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, add_extra_token_to_sequence=extra,
                              drop_last_partial_validation_sequence=drop_last, path_to_cache=str(tmp_path))
    ds = GPTDataset.from_prefix(golden_corpus, config, num_samples, split)
    assert len(ds) == want["n"] and len(ds.document_index) == want["ndoc"]
    assert ds.document_index[:20].tolist() == want["doc"]
    assert ds.sample_index[:8].tolist() == want["rows"]
    assert ds.shuffle_index[:len(want["shuffle"])].tolist() == want["shuffle"]
    assert ds.shuffle_index[-5:].tolist() == want["tail"]
    assert ds.document_index.dtype == np.int32 and ds.sample_index.dtype == np.int32
    assert ds.shuffle_index.dtype == np.uint32
    sample = ds[3]
    assert sample["tokens"].tolist() == want["tokens3"] and sample["labels"].tolist() == want["labels3"]


def _stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.dataset[int(s)] for s in ds.document_index]).astype(np.int64)


@pytest.mark.parametrize("seq_len, num_samples", [(16, None), (7, 500), (64, 40)])
def test_samples_are_contiguous_windows_of_the_shuffled_stream(tmp_path: Path, seq_len: int,
                                                                num_samples: int | None) -> None:
    rng = np.random.default_rng(seq_len)
    prefix = write_counter_corpus(tmp_path / "c", rng.integers(0, 40, 60).tolist(), dtype=np.int32)
    config = GPTDatasetConfig(random_seed=5, sequence_length=seq_len)
    ds = GPTDataset.from_prefix(prefix, config, num_samples)
    stream = _stream(ds)
    assert num_samples is None or len(ds) >= num_samples
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        s = ds.sample(i)
        window = stream[j * seq_len: j * seq_len + seq_len + 1]
        assert s["tokens"].shape == (seq_len,) and window.shape == (seq_len + 1,)
        assert np.array_equal(s["tokens"], window[:-1]) and np.array_equal(s["labels"], window[1:])


def test_small_corpus_is_cycled(tmp_path: Path) -> None:
    lengths = [5, 9, 0, 3]
    prefix = write_counter_corpus(tmp_path / "c", lengths)
    ds = GPTDataset.from_prefix(prefix, GPTDatasetConfig(random_seed=1, sequence_length=4), 50)
    epochs = len(ds.document_index) // len(lengths)
    assert epochs * sum(lengths) >= 50 * 4 + 1 and len(ds) >= 50
    assert np.bincount(ds.document_index).tolist() == [epochs] * len(lengths)
    seen = np.concatenate([ds.sample(i)["tokens"] for i in range(len(ds))])
    assert set(seen.tolist()) == set(range(1, sum(lengths) + 1))


def test_deterministic_per_seed(tmp_path: Path) -> None:
    prefix = write_counter_corpus(tmp_path / "c", list(range(1, 60)))
    make = lambda seed, cache: GPTDataset.from_prefix(  # noqa: E731
        prefix, GPTDatasetConfig(random_seed=seed, sequence_length=32, path_to_cache=str(tmp_path / cache)), 100)
    a, b, c = make(3, "a"), make(3, "b"), make(4, "c")
    assert all(np.array_equal(a.sample(i)["tokens"], b.sample(i)["tokens"]) for i in range(len(a)))
    assert not all(np.array_equal(a.sample(i)["tokens"], c.sample(i)["tokens"]) for i in range(len(a)))
    # order of access does not matter: a sample is a pure function of its index
    assert np.array_equal(a.sample(7)["tokens"], make(3, "a").sample(7)["tokens"])


def test_cache_reused_then_rebuilt_when_corpus_changes(tmp_path: Path, monkeypatch) -> None:
    prefix = write_counter_corpus(tmp_path / "c", [10, 20, 30, 40])
    config = GPTDatasetConfig(random_seed=1, sequence_length=8)
    first = GPTDataset.from_prefix(prefix, config, 30)
    cache_dir = Path(prefix) / "cache" / "GPTDataset_indices"  # megatron's default location
    assert first.cache_dir == str(cache_dir)
    assert len(list(cache_dir.glob("*-GPTDataset-train-*"))) == 4
    assert not list(cache_dir.glob(".*"))  # no temporary files left behind
    before = [first.sample(i)["tokens"].tolist() for i in range(len(first))]

    def no_build(*args, **kwargs):
        raise AssertionError("index rebuilt although the cache is valid")

    monkeypatch.setattr(gpt_module, "build_gpt_indices", no_build)
    again = GPTDataset.from_prefix(prefix, config, 30)
    assert isinstance(again.sample_index, np.memmap)
    assert [again.sample(i)["tokens"].tolist() for i in range(len(again))] == before
    monkeypatch.undo()

    # Rewrite the corpus: other lengths and other tokens.
    write_counter_corpus(tmp_path / "c", [33, 7, 25, 41, 2], start=500)
    rebuilt = GPTDataset.from_prefix(prefix, config, 30)
    fresh = GPTDataset.from_prefix(prefix, GPTDatasetConfig(random_seed=1, sequence_length=8,
                                                            path_to_cache=str(tmp_path / "fresh")), 30)
    after = [rebuilt.sample(i)["tokens"].tolist() for i in range(len(rebuilt))]
    assert after != before and min(min(t) for t in after) >= 500
    assert after == [fresh.sample(i)["tokens"].tolist() for i in range(len(fresh))]
    assert len(list(cache_dir.glob("*-description.txt"))) == 2


def test_explicit_cache_dir_keeps_corpus_dir_clean(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    prefix = write_counter_corpus(tmp_path / "data" / "c", [10, 20, 30])
    ds = GPTDataset.from_prefix(prefix, GPTDatasetConfig(random_seed=1, sequence_length=8,
                                                         path_to_cache=str(tmp_path / "cache")))
    assert ds.cache_dir == str(tmp_path / "cache") and len(os.listdir(tmp_path / "cache")) == 4
    assert sorted(os.listdir(tmp_path / "data")) == ["c.bin", "c.idx"]


def test_unwritable_default_cache_builds_in_memory(tmp_path: Path, monkeypatch) -> None:
    prefix = write_counter_corpus(tmp_path / "c", [10, 20, 30])

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("hyperpar.data.megatron.cache.os.makedirs", read_only)
    ds = GPTDataset.from_prefix(prefix, GPTDatasetConfig(random_seed=1, sequence_length=8))
    assert ds.cache_dir is None and len(ds) == 7
    with pytest.raises(DataError, match="cannot write"):
        GPTDataset.from_prefix(prefix, GPTDatasetConfig(random_seed=1, sequence_length=8,
                                                        path_to_cache=str(tmp_path / "ro")))


def _reference_masks(tokens: list[int], reset: bool) -> list[int]:
    pos, out = 0, []
    for t in tokens:
        out.append(pos)
        pos = 0 if (reset and t == EOD) else pos + 1
    return out


def test_eod_loss_mask_and_position_reset(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_item(np.append(rng.integers(1, 50, int(rng.integers(1, 12))), EOD))
        builder.end_document()
    builder.finalize(str(tmp_path / "e.idx"))
    config = GPTDatasetConfig(random_seed=2, sequence_length=16, eod_token_id=EOD, eod_mask_loss=True,
                              reset_position_ids=True, reset_attention_mask=True, create_attention_mask=True)
    ds = GPTDataset.from_prefix(str(tmp_path / "e"), config)
    for i in range(len(ds)):
        s = ds[i]
        tokens = s["tokens"].tolist()
        assert s["tokens"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
        assert s["loss_mask"].tolist() == [0.0 if t == EOD else 1.0 for t in tokens]
        assert s["position_ids"].tolist() == _reference_masks(tokens, reset=True)
        mask = s["attention_mask"][0]
        for q in range(16):  # True = masked; a query sees its own document part, causally
            start = q - s["position_ids"][q].item()
            assert mask[q].tolist() == [not (start <= k <= q) for k in range(16)]
    assert ds[None]["loss_mask"].sum() == 0


def test_partial_final_sample_is_padded_and_masked(golden_corpus: str) -> None:
    config = GPTDatasetConfig(random_seed=99, sequence_length=8, drop_last_partial_validation_sequence=False)
    ds = GPTDataset.from_prefix(golden_corpus, config, None, "valid")
    last = int(np.flatnonzero(ds.shuffle_index == len(ds) - 1)[0])
    s = ds.sample(last)
    real = sum(GOLDEN_LENGTHS) - 1 - (len(ds) - 1) * 8  # labels left for the final window
    assert s["loss_mask"].tolist() == [1.0] * real + [0.0] * (8 - real)
    assert s["labels"][real:].tolist() == [0] * (8 - real)  # pad id -1 rewritten to 0


def test_megatron_source(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.int32)
    for n in range(3, 40):
        builder.add_item(np.append(np.arange(100 + n, 100 + 2 * n), EOD))
        builder.end_document()
    builder.finalize(str(tmp_path / "s.idx"))
    src = MegatronSource(prefix=str(tmp_path / "s"), seq_len=12, num_samples=25, seed=3, eod_token_id=EOD,
                         eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert len(src) == 25
    ref = src.dataset
    for i in range(25):
        item = src[i]
        raw = ref.sample(i)
        assert set(item) == {"input_ids", "labels", "position_ids"}  # every key is a model input
        for key in ("input_ids", "labels", "position_ids"):
            assert item[key].shape == (12,) and item[key].dtype == torch.int64
        assert item["input_ids"].tolist() == raw["tokens"].tolist()
        assert item["labels"].tolist() == [lab if m else -100 for lab, m in zip(raw["labels"], raw["loss_mask"])]
        # documents start (position 0) exactly after each EOD
        ids, pos = item["input_ids"].tolist(), item["position_ids"].tolist()
        assert pos[0] == 0 and all((p == 0) == (ids[t - 1] == EOD) for t, p in enumerate(pos) if t)
    with pytest.raises(IndexError):
        src[25]
    with pytest.raises(DataError):
        MegatronSource(seq_len=12, num_samples=5)
    with pytest.raises(DataError, match="eod"):
        MegatronSource(prefix=str(tmp_path / "s"), seq_len=12, num_samples=5, eod_mask_loss=True)
    with pytest.raises(DataError, match="no sample"):
        MegatronSource(prefix=str(tmp_path / "s"), seq_len=5000, num_samples=None)
