"""Turn a (possibly sharded) meta-device model into real tensors without ever holding all of it.

Fresh init: each parameter is produced in full on every rank, one at a time, by a pure function
of (seed, parameter name), and each rank keeps only its own shard. So any layout gets bit-identical
initial weights and the peak extra memory is one full parameter.

Checkpoint loading: each rank asks the source for the box of the checkpoint tensor its shard
covers (``source(name, shape, index)``), which a lazy safetensors reader serves by slicing, so a
rank never reads the full tensor of a sharded parameter.
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


Box = tuple[slice, ...]


def _dim_placements(placements, dim: int) -> list:
    """The placements of a 1-D index tensor that follows tensor dim ``dim``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim == dim:
            out.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim == dim:
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return out


def local_indices(param: DTensor) -> list[torch.Tensor]:
    """Per tensor dim, the global indices of this rank's local shard, from DTensor's own split rules
    (so padding, uneven and strided FSDP-over-TP shards come out right)."""
    out = []
    for dim, n in enumerate(param.shape):
        idx = torch.arange(n, device=param.device)
        placements = _dim_placements(param.placements, dim)
        if any(not p.is_replicate() for p in placements):
            idx = distribute_tensor(idx, param.device_mesh, placements, src_data_rank=None).to_local()
        out.append(idx.cpu())
    return out


def _box(indices: list[torch.Tensor]) -> tuple[Box, list[torch.Tensor | None]]:
    """The bounding box of the indices and, per dim, the positions inside it to keep (None: all)."""
    box, picks = [], []
    for idx in indices:
        if idx.numel() == 0:
            box.append(slice(0, 0))
            picks.append(None)
            continue
        lo, hi = int(idx.min()), int(idx.max()) + 1
        box.append(slice(lo, hi))
        contiguous = hi - lo == idx.numel() and bool((idx == torch.arange(lo, hi)).all())
        picks.append(None if contiguous else idx - lo)
    return tuple(box), picks


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(param, DTensor):
            shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full.to(param.device))


# A parameter's box is read in row chunks: the transient copy stays below a quarter of the shard
# and below this many bytes, so loading peaks at (local shards + one chunk), not twice the shard.
READ_CHUNK_BYTES = 64 * 2**20


def _load_local(param: torch.Tensor, name: str, source: Callable[..., torch.Tensor]) -> tuple[int, int]:
    """Fill ``param`` (this rank's shard) from the source; returns (bytes read, largest read)."""
    shape = tuple(param.shape)
    dest = param.to_local() if isinstance(param, DTensor) else param
    if isinstance(param, DTensor):
        box, picks = _box(local_indices(param))
    else:
        box, picks = tuple(slice(0, n) for n in shape), [None] * len(shape)
    if not shape:  # a scalar
        t = source(name, shape, None)
        dest.copy_(t.to(device=dest.device, dtype=dest.dtype))
        return t.element_size(), t.element_size()
    rows = box[0].stop - box[0].start
    row_bytes = max(1, dest[:1].numel() * 4)  # fp32 reads
    per = max(1, min(READ_CHUNK_BYTES // row_bytes, -(-rows // 4)))
    # With a strided pick on dim 0 the chunk boundaries follow the picked rows, not the box.
    targets = picks[0] if picks[0] is not None else torch.arange(rows)
    total = largest = 0
    for lo in range(0, len(targets), per):
        want = targets[lo : lo + per]
        r0, r1 = int(want.min()), int(want.max()) + 1
        sub = (slice(box[0].start + r0, box[0].start + r1), *box[1:])
        t = source(name, shape, sub)
        n = t.numel() * t.element_size()
        total += n
        largest = max(largest, n)
        if picks[0] is not None:
            t = t.index_select(0, want - r0)
        for dim, pick in enumerate(picks[1:], start=1):
            if pick is not None:
                t = t.index_select(dim, pick)
        dest[lo : lo + len(want)].copy_(t.to(device=dest.device, dtype=dest.dtype))
    return total, largest


def materialize(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    source: Callable[..., torch.Tensor] | None = None,
    report: dict | None = None,
) -> nn.Module:
    """Allocate on ``device`` and fill every parameter.

    ``source(name, shape, index)`` returns the box ``index`` (a tuple of slices; None: all) of a
    parameter's checkpoint tensor; without it, ``model.init_param(name, full, generator)``
    initialises it. ``report`` (optional) receives ``local_param_bytes``, ``read_bytes`` (total
    read from the source) and ``max_read_bytes`` (the largest single read).
    """
    model.to_empty(device=device)
    local_bytes = read_total = read_max = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            cname = canonical_name(name)
            local = param.to_local() if isinstance(param, DTensor) else param
            local_bytes += local.numel() * local.element_size()
            if source is not None:
                n, largest = _load_local(param, cname, source)
                read_total += n
                read_max = max(read_max, largest)
                continue
            full = torch.empty(tuple(param.shape), dtype=torch.float32)
            model.init_param(cname, full, param_generator(seed, cname))
            _assign(param, full.to(param.dtype))
        model.init_buffers()
    if report is not None:
        report.update(local_param_bytes=local_bytes, read_bytes=read_total, max_read_bytes=read_max)
    return model
