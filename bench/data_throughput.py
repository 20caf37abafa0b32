"""Megatron data path throughput: corpus write, GPT index build, sample reads in shuffled order.

    PYTHONPATH=src python bench/data_throughput.py [--dir DIR] [--size-mb 200] [--seq-len 4096]

Writes a synthetic uint16 corpus (random document lengths) once into DIR (a temporary directory
by default, removed afterwards), builds the GPT index cold and loads it warm, then reads samples
in the dataset's (shuffled) order through GPTDataset and through MegatronSource.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hyperpar.data.megatron import GPTDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from hyperpar.data.megatron.blend import build_blending_indices  # noqa: E402
from hyperpar.data.megatron.source import MegatronSource  # noqa: E402

EOD = 0


def write_corpus(prefix: str, size_mb: int, seed: int) -> float:
    """~size_mb MB of uint16 tokens in documents of log-normal length (median ~900 tokens)."""
    rng = np.random.default_rng(seed)
    total = size_mb * (1 << 20) // 2
    t0 = time.perf_counter()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < total:
        lengths = np.clip(rng.lognormal(6.8, 1.0, 4096).astype(np.int64), 1, 64_000)
        tokens = rng.integers(1, 50_000, int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - 1] = EOD
        start = 0
        for n in lengths.tolist():
            if written >= total:
                break
            builder.add_document(tokens[start:start + n], [n])
            start += n
            written += n
    builder.finalize(prefix + ".idx")
    return time.perf_counter() - t0


def read_rate(get, count: int, seq_len: int, budget_s: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    while n < count and time.perf_counter() - t0 < budget_s:
        get(n)
        n += 1
    return n, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="keep the corpus here (reused when present)")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1, help="sample count = epochs x one epoch")
    parser.add_argument("--read-seconds", type=float, default=10.0, help="time budget per read pass")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    root = args.dir or tempfile.mkdtemp(prefix="hyperpar_bench_")
    os.makedirs(root, exist_ok=True)
    prefix = os.path.join(root, f"synthetic_{args.size_mb}mb")
    try:
        if not IndexedDataset.exists(prefix):
            secs = write_corpus(prefix, args.size_mb, args.seed)
            print(f"corpus write          {secs:8.2f} s")
        corpus = IndexedDataset(prefix)
        tokens = int(corpus.sequence_lengths.sum(dtype=np.int64))
        print(f"corpus                {os.path.getsize(prefix + '.bin') / 2**20:8.1f} MB, {len(corpus)} documents, "
              f"{tokens / 1e6:.1f} M tokens")

        per_epoch = (tokens - 1) // args.seq_len
        num_samples = per_epoch * args.epochs if args.epochs > 1 else None
        cache = tempfile.mkdtemp(prefix="idx_", dir=root)
        config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_len, path_to_cache=cache,
                                  eod_token_id=EOD)
        t0 = time.perf_counter()
        ds = GPTDataset.from_prefix(prefix, config, num_samples)
        print(f"index build (cold)    {time.perf_counter() - t0:8.2f} s  ({len(ds)} samples of {args.seq_len}+1)")
        t0 = time.perf_counter()
        ds = GPTDataset.from_prefix(prefix, config, num_samples)
        print(f"index load (cached)   {time.perf_counter() - t0:8.2f} s")

        n, secs = read_rate(ds.sample, len(ds), args.seq_len, args.read_seconds)
        print(f"GPTDataset.sample     {n / secs:8.0f} samples/s  {n * args.seq_len / secs / 1e6:8.1f} M tokens/s"
              f"  ({n} samples)")
        src = MegatronSource(prefix=prefix, seq_len=args.seq_len, num_samples=num_samples or len(ds),
                             seed=args.seed, cache_dir=cache)
        n, secs = read_rate(src.__getitem__, len(src), args.seq_len, args.read_seconds)
        print(f"MegatronSource[i]     {n / secs:8.0f} samples/s  {n * args.seq_len / secs / 1e6:8.1f} M tokens/s"
              f"  ({n} samples)")

        t0 = time.perf_counter()
        build_blending_indices([0.5, 0.3, 0.2], 1_000_000)
        print(f"blend schedule        {time.perf_counter() - t0:8.2f} s  (3 corpora, 1 M samples)")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
