"""Parameters that tensor parallelism shards, as the kernels see them.

Kernels that run on plain tensors (the GatedDeltaNet recurrence, grouped expert GEMMs, the causal
conv) read a sharded parameter through ``local``: this rank's shard, with gradients flowing back
into that shard. The model files stay free of mesh code; a parameter that is not distributed
passes through unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) parameter.

    Only for parameters whose every placement is a shard (or that no placement touches the dims
    the kernel reduces over): a replicated parameter used on head-sharded activations would get
    a partial gradient, and parallelizers give those a DTensor-aware module instead.
    """
    if isinstance(t, DTensor):
        return t.to_local()
    return t
