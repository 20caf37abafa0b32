"""The training objective: the one place that knows the global token count.

For one micro-batch, ``Objective`` turns a model's output into the quantity whose gradient is the
step's gradient share:

    Σ token CE / global valid tokens
  + aux_coef · load-balancing loss / global micro-batches
  + mtp_weight · Σ MTP token CE / global MTP tokens

The normalisers (``StepTotals``) are reduced once per step over the ranks that hold different
data (data and context parallel), so N processes differentiate exactly the loss of one process
that sees the whole batch; tensor-parallel ranks compute the same objective.

Under context parallelism (``cp``, a ``SequenceShard``) the labels come in whole rows (pre-shifted)
and are cut here like the model's inputs: each rank's token CE and token count cover its shard
only, so every token counts once; the MTP targets (one further along) are cut from the whole row,
so none is lost at a shard edge. ``targets`` builds them once per micro-batch, before the step's
normalisers are counted, from the labels and the positions / mask the model gets: a stream row that
joins two packed documents or touches padding has no target. Router statistics are summed over cp before the load-balancing
loss (it pools over the whole sequence); every cp rank then holds the same aux loss and adds
1/cp of it, so the objective summed over ranks, its gradient and the logged aux are one process's. The trainer's step
and a pipeline schedule's ``loss_fn`` call the same object.

Under loss parallelism the logits are a vocab-sharded DTensor and the cross-entropy runs sharded
(``torch.distributed.tensor.parallel.loss_parallel``): no rank holds full-vocab logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hyperpar.models.layers.documents import mtp_stream_rows
from hyperpar.models.layers.moe import load_balancing_loss
from hyperpar.models.layers.lm_head import HeadInput
from hyperpar.train.cross_entropy import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum
from hyperpar.models.output import ModelOutput

if TYPE_CHECKING:
    from hyperpar.distributed.context_parallel import SequenceShard

def token_loss_sum(logits: torch.Tensor | HeadInput, labels: torch.Tensor,
                   grad_hint: torch.Tensor | None = None, *, logit_grad_in_forward: bool = False,
                   compiled: bool = False) -> torch.Tensor:
    """Σ per-token cross-entropy in fp32 over pre-shifted ``labels`` (-100 ignored). ``logits`` may
    be a vocab-sharded DTensor (inside ``loss_parallel``: PyTorch's parallel cross-entropy); plain
    logits take the chunked kernel of :mod:`hyperpar.train.cross_entropy`, a fused head's
    ``HeadInput`` its matmul-and-loss kernel. ``grad_hint``: the gradient this sum will get, which
    the fused kernel applies in its forward, and the plain one too with ``logit_grad_in_forward``
    (then the logits' gradient lives from this forward to the backward). ``compiled``
    (``train.compile``): the kernels' per-row passes compiled. A plain scalar."""
    if isinstance(logits, HeadInput) and isinstance(logits.weight, DTensor):  # parallel.fsdp_vocab_parallel
        from hyperpar.distributed.dp_vocab import sharded_linear_cross_entropy_sum

        return sharded_linear_cross_entropy_sum(logits.hidden.flatten(0, -2), logits.weight, labels.flatten(),
                                                grad_hint if grad_hint is not None else 1.0)
    if isinstance(logits, HeadInput):
        return linear_cross_entropy_sum(logits.hidden.flatten(0, -2), logits.weight, labels.flatten(),
                                        grad_hint if grad_hint is not None else 1.0, compiled=compiled)
    if not isinstance(logits, DTensor):
        hint = grad_hint if logit_grad_in_forward else None
        return cross_entropy_sum(logits.flatten(0, -2), labels.flatten(), hint, compiled=compiled)
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


@dataclass
class StepTotals:
    """Normalisers of one optimizer step, equal on every rank."""

    tokens: torch.Tensor  # valid label tokens of the global batch (fp32 scalar)
    micro_batches: int  # micro-batches of the global batch (the aux loss is a per-forward mean)
    mtp_tokens: torch.Tensor | None = None  # valid MTP targets of the global batch


@dataclass
class MicroBatchLoss:
    """Detached parts of one micro-batch's objective, for logging (sums, not yet normalised)."""

    lm_sum: torch.Tensor
    aux: torch.Tensor | None = None  # aux_coef · load-balancing loss of this forward
    mtp_sum: torch.Tensor | None = None


class Objective:
    def __init__(self, *, mtp_weight: float = 0.0, loss_parallel: bool = False,
                 cp: SequenceShard | None = None, compiled: bool = False) -> None:
        self.mtp_weight = float(mtp_weight)
        self.loss_parallel = loss_parallel
        self.cp = cp
        self.compiled = compiled  # train.compile: the cross-entropy's passes as compiled kernels

    def targets(self, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """What a micro-batch's objective reads, from its (B, S) labels and the positions / mask the
        model gets: the labels themselves, or with MTP (B, 2, S): the labels and the MTP targets
        (``labels[:, t + 1]`` for stream row t, -100 where the row joins two documents or touches
        padding (no document alone has it), and at the row's end). One tensor with the batch first,
        so a pipeline schedule splits it into micro-batches like the labels."""
        if self.mtp_weight <= 0:
            return labels
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        rows = mtp_stream_rows(position_ids, attention_mask)
        if rows is not None:
            shifted[:, :-1].masked_fill_(~rows.to(labels.device), IGNORE_INDEX)
        return torch.stack([labels, shifted], dim=1)

    def lm_labels(self, targets: torch.Tensor) -> torch.Tensor:
        """The labels this rank's logits predict (its sequence shard under cp)."""
        labels = targets[:, 0] if targets.dim() == 3 else targets
        return self.cp.take(labels) if self.cp is not None else labels

    def mtp_labels(self, targets: torch.Tensor) -> torch.Tensor:
        """The MTP targets of this rank's stream rows (plain labels: ``labels[:, t + 1]`` unmasked)."""
        S = targets.shape[-1]
        shifted = targets[:, 1, :-1] if targets.dim() == 3 else targets[:, 1:]
        return self.cp.take(shifted, full=S) if self.cp is not None else shifted

    def context(self) -> contextlib.AbstractContextManager:
        """Forward-to-backward context: sharded cross-entropy under loss parallelism."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def __call__(self, out: ModelOutput | torch.Tensor, labels: torch.Tensor,
                 totals: StepTotals, *, logit_grad_in_forward: bool = False) -> tuple[torch.Tensor, MicroBatchLoss]:
        """The micro-batch's objective and its parts. ``logit_grad_in_forward``: plain (unfused)
        logits of the main loss get their gradient formed in this forward (cheaper); for a caller
        that drops its own reference to the logits before the backward (the trainer), so they are
        never held next to it. The MTP loss keeps the lazy gradient: formed in its forward it would
        coexist with both logits and the main loss's gradient."""
        logits = out.logits if isinstance(out, ModelOutput) else out
        # the gradient each sum gets in backward, as autograd forms it below (1 / tokens, then × weight)
        per_token = torch.ones((), dtype=torch.float32, device=totals.tokens.device) / totals.tokens
        lm_sum = token_loss_sum(logits, self.lm_labels(labels), per_token, logit_grad_in_forward=logit_grad_in_forward,
                                compiled=self.compiled)
        objective = lm_sum / totals.tokens
        parts = MicroBatchLoss(lm_sum.detach())
        if isinstance(out, ModelOutput) and out.router_stats is not None:
            stats, share = out.router_stats, 1.0
            if self.cp is not None:
                stats, share = self.cp.sum_router_stats(stats), 1.0 / self.cp.cp
            aux = out.aux_coef * share * load_balancing_loss(stats)
            objective = objective + aux.float() / totals.micro_batches
            parts.aux = aux.detach().float()
        if isinstance(out, ModelOutput) and out.mtp_logits is not None and totals.mtp_tokens is not None:
            mtp_hint = torch.ones((), dtype=torch.float32, device=totals.mtp_tokens.device) / totals.mtp_tokens * self.mtp_weight
            mtp_sum = token_loss_sum(out.mtp_logits, self.mtp_labels(labels), mtp_hint, compiled=self.compiled)
            objective = objective + self.mtp_weight * mtp_sum / totals.mtp_tokens
            parts.mtp_sum = mtp_sum.detach()
        return objective, parts

    def totals(self, labels: list[torch.Tensor], global_micro_batches: int, reduce) -> StepTotals:
        """The step's normalisers from this rank's micro-batch labels (whole rows); ``reduce(t)``
        sums a tensor over the ranks holding different data (``dp_cp``)."""
        tokens = reduce(sum(count_valid_tokens(self.lm_labels(lb)) for lb in labels).to(torch.float32))
        mtp = None
        if self.mtp_weight > 0:
            mtp = reduce(sum(count_valid_tokens(self.mtp_labels(lb)) for lb in labels).to(torch.float32)).clamp_min(1.0)
        return StepTotals(tokens=tokens, micro_batches=global_micro_batches, mtp_tokens=mtp)

