"""Rank-aware, stateful loader over a SampleSource.

Step s uses global samples [s*G, (s+1)*G). Data-parallel rank r takes the contiguous slice
[r*G/dp, (r+1)*G/dp) and splits it into micro-batches; ranks that differ only in TP/CP/PP see the
same data. The state is just the step counter, so a resume on any layout continues exactly.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyperpar.data.collate import collate_text
from hyperpar.data.pad import pad_to_multiple
from hyperpar.data.registry import SampleSource


class DistributedBatchLoader:
    def __init__(
        self,
        source: SampleSource,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collate: Callable[[list[dict]], dict] | None = None,
        seq_multiple: int = 1,
        pad_id: int = 0,
    ) -> None:
        assert global_batch_size % (micro_batch_size * dp_size) == 0
        self.source = source
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.collate = collate or getattr(source, "collate", None) or collate_text
        self.seq_multiple = seq_multiple
        self.pad_id = pad_id
        self.step = 0

    @classmethod
    def for_layout(cls, source: SampleSource, parallel_dims, train_cfg, pad_id: int = 0) -> DistributedBatchLoader:
        """The loader of this rank under ``parallel_dims``: its data-parallel slice, rows padded to the
        layout's sequence split (see :mod:`hyperpar.data.pad`)."""
        dp = parallel_dims.submesh("dp")
        return cls(source, global_batch_size=train_cfg.global_batch_size, micro_batch_size=train_cfg.micro_batch_size,
                   dp_rank=dp.get_local_rank(), dp_size=dp.size(), seq_multiple=parallel_dims.seq_multiple,
                   pad_id=pad_id)

    def indices_for_step(self, step: int) -> list[int]:
        per_rank = self.global_batch_size // self.dp_size
        start = step * self.global_batch_size + self.dp_rank * per_rank
        return list(range(start, start + per_rank))

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the next optimizer step for this rank."""
        idx = self.indices_for_step(self.step)
        self.step += 1
        mb = self.micro_batch_size
        return [pad_to_multiple(self.collate([self.source[i] for i in idx[j : j + mb]]), self.seq_multiple, self.pad_id)
                for j in range(0, len(idx), mb)]

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            # Sample order is defined by global index: a different global batch continues from the
            # first sample not yet consumed only if it divides evenly.
            consumed = state["step"] * state["global_batch_size"]
            if consumed % self.global_batch_size:
                raise ValueError("cannot resume: consumed samples not a multiple of the new global batch size")
            self.step = consumed // self.global_batch_size
        else:
            self.step = int(state["step"])
