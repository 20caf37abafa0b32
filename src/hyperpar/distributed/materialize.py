"""Turn a (possibly sharded) meta-device model into real tensors without ever holding all of it.

Each parameter is produced in full on every rank, one at a time, by a pure function of
(seed, parameter name) or read from the checkpoint, and each rank keeps only its own shard. So any
layout gets bit-identical initial weights and the peak extra memory is one full parameter.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyperpar.models.param_names import canonical_name


def param_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(param, DTensor):
            shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full.to(param.device))


def materialize(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    source: Callable[[str, tuple[int, ...]], torch.Tensor] | None = None,
) -> nn.Module:
    """Allocate on ``device`` and fill every parameter.

    ``source(name, shape)`` returns the full tensor for a parameter (checkpoint loading); without
    it, ``model.init_param(name, full, generator)`` initialises it.
    """
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            cname = canonical_name(name)
            shape = tuple(param.shape)
            if source is not None:
                full = source(cname, shape)
            else:
                full = torch.empty(shape, dtype=torch.float32)
                model.init_param(cname, full, param_generator(seed, cname))
            _assign(param, full.to(param.dtype))
        model.init_buffers()
    return model
