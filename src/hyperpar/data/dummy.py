"""Deterministic synthetic text: sample i depends only on (seed, i), so every layout sees the same data.

Each sample is an arithmetic progression modulo the vocabulary with a little noise, so the loss of
a working model drops visibly within a few steps (pure noise would sit at log(vocab)).
"""

from __future__ import annotations

import torch

from hyperpar.data.registry import DataContext, register_dataset


def sample_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 7_919 + index * 104_729 + 1) % (2**63))


class DummyTextSource:
    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, num_samples: int, noise: float = 0.05) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_samples = num_samples
        self.noise = noise

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, index: int, length: int) -> torch.Tensor:
        g = sample_generator(self.seed, index)
        v = self.vocab_size
        start = int(torch.randint(0, v, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        seq = (start + stride * torch.arange(length, dtype=torch.int64)) % v
        noisy = torch.rand(length, generator=g) < self.noise
        seq[noisy] = torch.randint(0, v, (int(noisy.sum()),), generator=g)
        return seq

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        seq = self.tokens(index, self.seq_len + 1)
        return {"input_ids": seq[:-1].clone(), "labels": seq[1:].clone()}


@register_dataset("dummy", extra=("noise",))
def build_dummy(options: dict, ctx: DataContext) -> DummyTextSource:
    extra = options.get("extra") or {}
    return DummyTextSource(seq_len=ctx.seq_len, vocab_size=ctx.vocab_size, seed=ctx.seed,
                           num_samples=ctx.num_samples, noise=float(extra.get("noise", 0.05)))
