"""What a model's forward returns when it has more than logits to say.

Models return a plain logits tensor (B, S, V) or a ModelOutput. The trainer forms the training loss:
    lm token-mean over the global batch
  + router_aux_loss_coef * mean over the global batch's micro-batches of aux_loss
  + mtp_loss_weight * token-mean over the global batch of the MTP cross-entropy
Each term is layout-invariant as long as the micro-batch size is the same, and each is logged apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, S, V)
    # Router load-balancing loss of this forward call, already multiplied by the checkpoint's
    # router_aux_loss_coef (None for dense models).
    aux_loss: torch.Tensor | None = None
    # Multi-token prediction: logits at positions 0..S-2 predicting the token two ahead, i.e. the
    # target of position t is labels[:, t + 1] (None when the model has no MTP or it is disabled).
    mtp_logits: torch.Tensor | None = None
