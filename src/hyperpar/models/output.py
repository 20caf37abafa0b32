"""What a model's forward returns when it has more than logits to say.

Models return a plain logits tensor (B, S, V) or a ModelOutput with the *raw* statistics the
training objective needs; the objective itself (``hyperpar.train.objective``) forms
    lm token-mean over the global batch
  + router_aux_loss_coef * mean over the global batch's micro-batches of the load-balancing loss
  + mtp_loss_weight * token-mean over the global batch of the MTP cross-entropy
so the normalisation is set in one place, over the right mesh (data, context and pipeline ranks),
and the same function is the step's loss and a pipeline schedule's ``loss_fn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hyperpar.models.layers.moe import RouterStats, load_balancing_loss


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, S, V); a vocab-sharded DTensor under loss parallelism
    # Router statistics of this forward call pooled over its MoE layers (None for dense models):
    # the load-balancing loss pools f and P over layers before the product, so it is formed from
    # these, not summed from per-layer losses.
    router_stats: RouterStats | None = None
    aux_coef: float = 0.0  # the checkpoint's router_aux_loss_coef
    # Multi-token prediction: logits at positions 0..S-2 predicting the token two ahead, i.e. the
    # target of position t is labels[:, t + 1] (None when the model has no MTP or it is disabled).
    mtp_logits: torch.Tensor | None = None

    @classmethod
    def of(cls, logits: torch.Tensor, stats: Sequence[RouterStats], aux_coef: float,
           mtp_logits: torch.Tensor | None = None) -> "ModelOutput":
        return cls(logits, RouterStats.pool(list(stats)) if stats else None, float(aux_coef), mtp_logits)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """``aux_coef ×`` the load-balancing loss of this call alone (what transformers reports)."""
        if self.router_stats is None:
            return None
        return self.aux_coef * load_balancing_loss(self.router_stats)
