"""FSDP's all-gathers and reduce-scatters through shared memory, for CPU ranks on one host.

``launch.cpu_collectives=shm`` (the default). Gloo moves every byte of a CPU collective through
TCP loopback, on the same cores that compute: on two cores an all-gather of 228 MB takes about
300 ms and a reduce-scatter 330 ms, against 47 ms for one plain copy of the same bytes. Ranks on
one host can instead share one file in ``/dev/shm`` per process group: each rank writes its part
into its own slot, waits at a barrier, and reads what it needs from the others' slots.

- All-gather: the rank's shard goes into its slot, and after the barrier the whole output is
  one copy out of the file.
- Reduce-scatter: FSDP asks the comm to ``allocate`` its reduce-scatter input, and gets the rank's
  slot of the file, so the gradients are written there directly by FSDP's own copy-in. After the
  barrier each rank sums its chunk of every rank's slot, in rank order. Every rank thus adds the
  same numbers in the same order as every other run with this many ranks; with two ranks the sum is
  bitwise gloo's (two-term addition commutes).

These are FSDP2's own extension points (``set_custom_all_gather`` / ``set_custom_reduce_scatter``),
so every other collective (HSDP's all-reduce, pipeline send/recv, expert all-to-all, checkpoints,
object collectives) stays on gloo untouched. A second barrier after the reads keeps a fast rank
from overwriting a slot that another rank is still reading. Barriers are gloo's: a barrier is a
round of socket syscalls, across which no CPU reorders the loads and stores around it.

The file is sized by the largest unit, grows when a larger one comes, and is unlinked as soon as
every rank has mapped it, so nothing is left in ``/dev/shm`` after a crash. Where the ranks do not
share one ``/dev/shm`` (several hosts), or it cannot hold the file, the group keeps gloo, with one
log line saying so.

Both comms, shared or not (``cpu_collectives=gloo``, one-rank units), allocate FSDP's collective
buffers without the NaN fill ``train.deterministic`` puts into every new tensor (see
``empty_unfilled``).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

log = logging.getLogger("hyperpar")

SHM_DIR = "/dev/shm"
SLOT_UNIT = 1 << 20  # bytes: slots are whole MiB, so every slot starts page- and cache-line-aligned


def _round_up(n: int) -> int:
    return (n + SLOT_UNIT - 1) // SLOT_UNIT * SLOT_UNIT


def _done_work() -> dist.Work:
    # The shared-memory step runs to completion in the caller; an async caller gets a finished Work.
    return torch._C._distributed_c10d.PythonCallbackWork(lambda timeout: True)


class SharedArena:
    """One ``/dev/shm`` file mapped by every rank of one process group, with one slot per rank.

    Every method is collective: each rank calls it in the same order with the same sizes, as FSDP's
    units do. ``slots`` returns None on every rank alike when the group cannot share memory.
    """

    def __init__(self, group: dist.ProcessGroup, label: str):
        self.group, self.label = group, label
        self.rank, self.size = group.rank(), group.size()
        self.capacity = 0  # bytes per slot
        self.buffer: torch.Tensor | None = None
        self.disabled = False

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _grow(self, slot_bytes: int) -> bool:
        slot_bytes = _round_up(max(slot_bytes, 2 * self.capacity))
        total = slot_bytes * self.size
        token = uuid.uuid4().hex
        path, problem = "", ""
        if self.rank == 0:
            path = os.path.join(SHM_DIR, f"hyperpar-{os.getpid()}-{self.label}-{token[:12]}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, total)  # a short /dev/shm fails here, not as SIGBUS later
                    os.pwrite(fd, token.encode(), 0)
                finally:
                    os.close(fd)
            except OSError as exc:
                problem = f"{SHM_DIR} cannot hold {total / 2**20:.0f} MB ({exc})"
                try:
                    os.unlink(path)
                except OSError:
                    pass
                path = ""
        box = [(path, token, problem)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        path, token, problem = box[0]
        buffer = None
        if path and not os.path.exists(path):  # from_file would create (and leak) a file of its own
            problem = "the ranks do not share one /dev/shm (several hosts)"
        elif path:
            try:
                buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
                if bytes(buffer[:len(token)].tolist()) != token.encode():
                    buffer, problem = None, "the ranks do not share one /dev/shm (several hosts)"
            except (OSError, RuntimeError) as exc:
                buffer, problem = None, f"rank {self.rank} cannot map {path} ({exc})"
        ok = torch.tensor([0 if buffer is None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)  # every rank mapped it, or none uses it
        if self.rank == 0 and path:
            os.unlink(path)
        if not ok.item():
            self.disabled = True
            if self.rank == 0 or problem:
                log.warning("cpu_collectives=shm: %s for %s; this group keeps gloo", problem or "another rank failed",
                            self.label)
            return False
        self.buffer, self.capacity = buffer, slot_bytes
        log.info("cpu_collectives=shm: %s file of %.0f MB (%d ranks)", self.label, total / 2**20, self.size)
        return True

    def slots(self, nbytes: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor] | None:
        """A view of ``numel`` elements of ``dtype`` in each rank's slot."""
        if self.disabled or (nbytes > self.capacity and not self._grow(nbytes)):
            return None
        assert self.buffer is not None
        c = self.capacity
        return [self.buffer[k * c:k * c + nbytes].view(dtype)[:numel] for k in range(self.size)]


_arenas: dict[tuple[int, str], SharedArena] = {}


def _arena(group: dist.ProcessGroup, role: str) -> SharedArena:
    key = (id(group), role)
    arena = _arenas.get(key)
    if arena is None or arena.group is not group:
        arena = _arenas[key] = SharedArena(group, f"{role}{len(_arenas)}")
    return arena


def release() -> None:
    """Unmap every arena (the end of a job: a next job in the same process has groups of its own)."""
    _arenas.clear()


def empty_unfilled(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` without the NaN fill of ``train.deterministic`` (``use_deterministic_algorithms``
    fills every new tensor: ~90 ms per 128 MB on one CPU thread). Only for FSDP's collective buffers,
    which the copy-in and the collective overwrite whole before anything reads them."""
    from torch.utils import deterministic

    fill = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False
    try:
        return torch.empty(*size, dtype=dtype, device=device)
    finally:
        deterministic.fill_uninitialized_memory = fill


class ShmAllGather(AllGather):
    """``shared=False``: gloo's all-gather, into a buffer allocated without the deterministic fill."""

    def __init__(self, shared: bool = True):
        self.shared = shared

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return empty_unfilled(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        n, w = input_tensor.numel(), group.size()
        arena = _arena(group, "all_gather")
        slots = None
        if self.shared and output_tensor.is_contiguous() and input_tensor.is_contiguous() and output_tensor.numel() == n * w:
            slots = arena.slots(n * input_tensor.element_size(), input_tensor.dtype, n)
        if slots is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        slots[arena.rank].copy_(input_tensor.view(-1))
        arena.barrier()
        out = output_tensor.view(w, n)
        for k, slot in enumerate(slots):
            out[k].copy_(slot)
        arena.barrier()  # nobody writes the next all-gather into a slot still being read
        return _done_work() if async_op else None


class ShmReduceScatter(ReduceScatter):
    """Lends FSDP the rank's slot as its reduce-scatter input (one ``allocate`` per reduce-scatter).
    ``shared=False``: gloo's reduce-scatter, with buffers allocated without the deterministic fill."""

    def __init__(self, group: dist.ProcessGroup, shared: bool = True):
        self.group, self.shared = group, shared
        self._lent: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        # FSDP allocates the input first, then the (smaller) output, which must stay private memory.
        if self.shared and self._lent is None and device.type == "cpu" and numel % self.group.size() == 0:
            arena = _arena(self.group, "reduce_scatter")
            slots = arena.slots(numel * dtype.itemsize, dtype, numel)
            if slots is not None:
                self._lent = slots[arena.rank]
                return self._lent.view(*size)
        return empty_unfilled(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        lent, self._lent = self._lent, None
        if lent is not None and lent.data_ptr() == output_tensor.data_ptr():
            # The output is FSDP's gradient shard; in the file the next reduce-scatter would overwrite it.
            raise RuntimeError("cpu_collectives=shm: the reduce-scatter output was allocated in shared memory "
                               "(FSDP allocated its buffers in an order this comm does not know)")
        w, n = group.size(), output_tensor.numel()
        plain = self.shared and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
        arena = _arena(group, "reduce_scatter")
        slots = None
        if plain and output_tensor.is_contiguous() and input_tensor.is_contiguous() and input_tensor.numel() == n * w:
            if lent is not None and lent.data_ptr() == input_tensor.data_ptr() and lent.numel() == input_tensor.numel():
                slots = arena.slots(lent.numel() * lent.element_size(), lent.dtype, lent.numel())
            else:
                slots = arena.slots(input_tensor.numel() * input_tensor.element_size(), input_tensor.dtype, n * w)
                if slots is not None:
                    slots[arena.rank].copy_(input_tensor.view(-1))
        if slots is None:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        arena.barrier()
        lo = arena.rank * n
        parts = [s[lo:lo + n] for s in slots]
        out = output_tensor.view(-1)
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        if op == dist.ReduceOp.AVG:
            out.div_(w)
        arena.barrier()  # every rank has read its chunk before anyone writes the next gradients
        return _done_work() if async_op else None


def _shard_group(module: FSDPModule) -> dist.ProcessGroup | None:
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1:
        return None
    return groups[0].mesh_info.shard_process_group


def install(parts: Iterable[nn.Module], shared: bool = True) -> int:
    """Give every FSDP unit of ``parts`` (on CPU) this module's all-gather and reduce-scatter: through
    shared memory where ``shared`` and its shard group has more than one rank, else gloo's; either way
    with buffers allocated without the deterministic fill (a one-rank unit allocates its
    reduce-scatter buffers every step too). Returns how many units go through shared memory."""
    gathers = {flag: ShmAllGather(flag) for flag in (True, False)}
    scatters: dict[tuple[int, bool], ShmReduceScatter] = {}
    n = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = _shard_group(module)
            if group is None:
                continue
            flag = shared and group.size() > 1
            module.set_custom_all_gather(gathers[flag])
            module.set_custom_reduce_scatter(scatters.setdefault((id(group), flag), ShmReduceScatter(group, flag)))
            n += flag
    return n
