"""The vocabulary projection, which can hand its matmul to the training objective.

With ``train.fused_head_loss`` (default on) the worker sets ``fused_loss`` on every ``LMHead`` of a
model it trains without pipeline parallelism. Then, for an fp32 input and weight that are plain
tensors (no tensor-parallel DTensor), ``forward`` returns a
:class:`HeadInput` (the hidden states and this weight) instead of logits, and the objective runs
the matmul inside the cross-entropy, chunk by chunk (``train.cross_entropy.linear_cross_entropy_sum``):
the (tokens x vocab) logits and their gradient are never whole. So does a 16-bit head on a CPU whose
16-bit matmuls run as fp32 GEMMs (``train.mixed_precision.cpu_matmul``): the kernel rounds to 16 bits
where the 16-bit head would. Anything else gets logits as before.
Called outside training (HF parity, export, evaluation) the flag is off and ``forward`` is ``Linear``'s.
A weight sharded by vocabulary over the data-parallel ranks (``parallel.fsdp_vocab_parallel``,
``distributed/dp_vocab.py``) is always handed over fused (the objective's sharded kernel), or,
outside training (no gradient), gathered whole where the flag is off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperpar.models.layers.cpu_matmul import Linear, upcast


@dataclass
class HeadInput:
    """What a fused head hands the objective in place of logits: ``logits = hidden @ weight.T``."""

    hidden: torch.Tensor  # (..., H)
    weight: torch.Tensor  # (V, H): the parameter itself (FSDP's unsharded one), so its gradient lands

    @staticmethod
    def fusable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if bias is not None or isinstance(x, DTensor) or isinstance(weight, DTensor) or x.dtype != weight.dtype:
            return False
        # 16-bit: where the CPU's 16-bit matmuls run as fp32 GEMMs anyway (cpu_matmul), which the
        # fused kernel then runs too, rounding where the 16-bit head would
        return x.dtype == torch.float32 or upcast(x)


def vocab_sharded(module: nn.Module) -> bool:
    """``module``'s weight is sharded by vocabulary over the data-parallel ranks
    (``distributed.dp_vocab.shard_vocab`` marks the module: materialising replaces the parameter)."""
    return getattr(module, "_hyperpar_dp_vocab", False) and isinstance(module.weight, DTensor)


class LMHead(Linear):
    """``Linear`` (same parameter, same keys, same TP plan) that defers its matmul to the objective
    when ``fused_loss`` is set and the input qualifies (see the module docstring)."""

    fused_loss = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | HeadInput:  # type: ignore[override]
        if vocab_sharded(self):
            # vocabulary rows spread over the data-parallel ranks (parallel.fsdp_vocab_parallel): the
            # objective's sharded kernel, or (outside it) logits from the gathered weight
            if self.fused_loss:
                return HeadInput(x, self.weight)
            if torch.is_grad_enabled():
                # full_tensor()'s backward would keep only this rank's tokens' share of the gradient
                raise RuntimeError("a vocabulary-sharded head (parallel.fsdp_vocab_parallel) trains only through "
                                   "the fused loss (train.fused_head_loss=true)")
            return nn.functional.linear(x, self.weight.full_tensor())
        if self.fused_loss and torch.is_grad_enabled() and HeadInput.fusable(x, self.weight, self.bias):
            return HeadInput(x, self.weight)
        return super().forward(x)


def fuse_head_loss(model: nn.Module, enabled: bool = True) -> int:
    """Set ``fused_loss`` on every ``LMHead`` of ``model``; returns how many there are."""
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    for head in heads:
        head.fused_loss = enabled
    return len(heads)
