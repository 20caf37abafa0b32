"""FSDP's all-gathers and reduce-scatters through shared memory, for CPU ranks on one host.

``launch.cpu_collectives=shm`` (the default). Gloo moves every byte of a CPU collective through
TCP loopback, on the same cores that compute: on two cores an all-gather of 228 MB takes about
300 ms and a reduce-scatter 330 ms, against 47 ms for one plain copy of the same bytes. Ranks on
one host can instead share one file in ``/dev/shm`` per process group: each rank writes its part
into its own slot, waits at a barrier, and reads what it needs from the others' slots.

- All-gather: FSDP asks the comm to ``allocate`` its all-gather output, and gets a region of the
  file laid out as that output, so FSDP's own copy-in writes the rank's shard straight into its
  chunk there. One barrier, and FSDP's copy-out reads every rank's chunk from the file: no copy of
  ours at all. The file holds three such regions: FSDP keeps one output after its copy-out in
  forward (freed at the next unit's), so two are in use while a third is filled. Which region the
  next all-gather gets is decided by every rank alike from what each rank still holds (see
  ``SharedArena.exchange``), so no rank ever writes a region another rank still reads; when all
  three are held (a prefetch pattern FSDP does not use today) that all-gather goes through gloo.
- Reduce-scatter: FSDP asks the comm to ``allocate`` its reduce-scatter input, and gets the rank's
  slot of the file, so the gradients are written there directly by FSDP's own copy-in. After the
  barrier each rank sums its chunk of every rank's slot, in rank order. Every rank thus adds the
  same numbers in the same order as every other run with this many ranks; with two ranks the sum is
  bitwise gloo's (two-term addition commutes). A second barrier after the reads keeps a fast rank
  from overwriting a slot that another rank is still reading.

These are FSDP2's own extension points (``set_custom_all_gather`` / ``set_custom_reduce_scatter``),
so every other collective (HSDP's all-reduce, pipeline send/recv, expert all-to-all, checkpoints,
object collectives) stays on gloo untouched. Barriers are gloo's: a barrier is a round of socket
syscalls, across which no CPU reorders the loads and stores around it.

The file is sized by the largest unit, grows when a larger one comes, and is unlinked as soon as
every rank has mapped it, so nothing is left in ``/dev/shm`` after a crash. Where the ranks do not
share one ``/dev/shm`` (several hosts), or it cannot hold the file, the group keeps gloo, with one
log line saying so.

Both comms, shared or not (``cpu_collectives=gloo``, one-rank units), allocate FSDP's collective
buffers without the NaN fill ``train.fill_uninitialized_memory`` puts into every new tensor (see
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

from hyperpar.unfilled import empty_unfilled

log = logging.getLogger("hyperpar")

SHM_DIR = "/dev/shm"
SLOT_UNIT = 1 << 20  # bytes: slots are whole MiB, so every slot starts page- and cache-line-aligned


HEADER = SLOT_UNIT  # bytes before the regions of an arena that has several: the token, then the masks
MASKS_AT = 4096  # where, in the header, each rank publishes which regions it still holds (two rounds)
GATHER_REGIONS = 3  # forward holds two all-gather outputs at once (one kept past its copy-out), one is filled


def _round_up(n: int) -> int:
    return (n + SLOT_UNIT - 1) // SLOT_UNIT * SLOT_UNIT


def _done_work() -> dist.Work:
    # The shared-memory step runs to completion in the caller; an async caller gets a finished Work.
    return torch._C._distributed_c10d.PythonCallbackWork(lambda timeout: True)


def _users(t: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``t``'s storage: a region FSDP still holds an
    output in counts more than the region alone."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def map_shared(group: dist.ProcessGroup, label: str, total: int) -> torch.Tensor | None:
    """A ``/dev/shm`` file of ``total`` bytes mapped by every rank of ``group``, as one uint8 tensor
    (collective). None on every rank alike when any rank cannot map it (several hosts, a short
    ``/dev/shm``), with one warning; the caller keeps gloo. The file is unlinked once every rank has
    mapped it, so nothing is left behind after a crash."""
    rank = group.rank()
    token = uuid.uuid4().hex
    path, problem = "", ""
    if rank == 0:
        path = os.path.join(SHM_DIR, f"hyperpar-{os.getpid()}-{label}-{token[:12]}")
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
    dist.broadcast_object_list(box, group=group, group_src=0)
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
            buffer, problem = None, f"rank {rank} cannot map {path} ({exc})"
    ok = torch.tensor([0 if buffer is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank mapped it, or none uses it
    if rank == 0 and path:
        os.unlink(path)
    if not ok.item():
        if rank == 0 or problem:
            log.warning("cpu_collectives=shm: %s for %s; this group keeps gloo", problem or "another rank failed", label)
        return None
    return buffer


class SharedArena:
    """One ``/dev/shm`` file mapped by every rank of one process group.

    ``regions=1`` (reduce-scatter): one slot per rank, see ``slots``. ``regions>1`` (all-gather): each
    region is one collective's whole output, lent to FSDP by ``lend``; each region is a storage of its
    own, so whether FSDP still holds it can be seen from its users (``_users``).

    Every method is collective: each rank calls it in the same order with the same sizes, as FSDP's
    units do. ``slots`` and ``lend`` return None on every rank alike when the group cannot share
    memory (or, for ``lend``, when every region is still held somewhere).
    """

    def __init__(self, group: dist.ProcessGroup, label: str, regions: int = 1):
        self.group, self.label, self.regions = group, label, regions
        self.rank, self.size = group.rank(), group.size()
        self.capacity = 0  # bytes per slot
        self.buffer: torch.Tensor | None = None
        self.disabled = False
        self.views: list[torch.Tensor] = []  # regions > 1: one tensor with a storage of its own per region
        self.idle_users: list[int] = []
        self.masks: torch.Tensor | None = None  # [2 rounds, ranks] of held-region bit masks, in the header
        self.round = 0
        self.next_region: int | None = 0

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _grow(self, slot_bytes: int) -> bool:
        slot_bytes = _round_up(max(slot_bytes, 2 * self.capacity))
        header = HEADER if self.regions > 1 else 0
        total = header + self.regions * slot_bytes * self.size
        buffer = map_shared(self.group, self.label, total)
        if buffer is None:
            self.disabled = True
            return False
        self.buffer, self.capacity = buffer, slot_bytes
        if self.regions > 1:
            # A region FSDP holds an output in after the file grew stays mapped through that output.
            flat, span = buffer.numpy(), slot_bytes * self.size
            self.views = [torch.frombuffer(flat[header + r * span:header + (r + 1) * span], dtype=torch.uint8)
                          for r in range(self.regions)]
            self.idle_users = [_users(v) for v in self.views]
            self.masks = buffer[MASKS_AT:MASKS_AT + 2 * 8 * self.size].view(torch.int64).view(2, self.size)
            self.round, self.next_region = 0, 0
        log.info("cpu_collectives=shm: %s file of %.0f MB (%d ranks)", self.label, total / 2**20, self.size)
        return True

    def _fits(self, slot_bytes: int) -> bool:
        return not self.disabled and (slot_bytes <= self.capacity or self._grow(slot_bytes))

    def slots(self, nbytes: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor] | None:
        """A view of ``numel`` elements of ``dtype`` in each rank's slot."""
        if not self._fits(nbytes):
            return None
        assert self.buffer is not None
        c = self.capacity
        return [self.buffer[k * c:k * c + nbytes].view(dtype)[:numel] for k in range(self.size)]

    def lend(self, slot_bytes: int, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """``numel`` elements of ``dtype`` (``slot_bytes`` per rank) in the region the last ``exchange``
        chose, or None (FSDP then allocates privately and the collective goes through gloo)."""
        if not self._fits(slot_bytes) or self.next_region is None:
            return None
        return self.views[self.next_region][:numel * dtype.itemsize].view(dtype)

    def exchange(self, sync) -> None:
        """Publish which regions this rank still holds, ``sync()`` (a collective every rank joins), and
        pick the next collective's region: one no rank held when it published. A rank reads a region
        only while it holds it, and every rank held its outputs since before it published, so the
        chosen region is read by nobody when the ranks start writing it (after the next ``allocate``)."""
        assert self.masks is not None
        held = sum(1 << r for r, v in enumerate(self.views) if _users(v) > self.idle_users[r])
        round_ = self.round
        self.masks[round_, self.rank] = held
        sync()
        # Two rounds of masks: a rank that is one collective ahead writes the other row.
        union = 0
        for m in self.masks[round_].tolist():
            union |= m
        self.round ^= 1
        self.next_region = next((r for r in range(self.regions) if not union >> r & 1), None)


_arenas: dict[tuple[int, str], SharedArena] = {}


def _arena(group: dist.ProcessGroup, role: str) -> SharedArena:
    key = (id(group), role)
    arena = _arenas.get(key)
    if arena is None or arena.group is not group:
        regions = GATHER_REGIONS if role == "all_gather" else 1
        arena = _arenas[key] = SharedArena(group, f"{role}{len(_arenas)}", regions)
    return arena


_installed: list["ShmAllGather"] = []


def gather_counts() -> dict[str, int]:
    """How many all-gathers of the installed comms went in place in shared memory, and through gloo."""
    counts = {"in_place": 0, "gloo": 0}
    for comm in _installed:
        for k, v in comm.counts.items():
            counts[k] += v
    return counts


def release() -> None:
    """Unmap every arena (the end of a job: a next job in the same process has groups of its own), and
    log how this job's all-gathers went."""
    counts = gather_counts()
    if counts["in_place"]:
        log.info("cpu_collectives=shm: %d all-gathers in place in shared memory, %d through gloo",
                 counts["in_place"], counts["gloo"])
    _installed.clear()
    _arenas.clear()


def _numel(size: Sequence[int]) -> int:
    numel = 1
    for s in size:
        numel *= int(s)
    return numel


class ShmAllGather(AllGather):
    """Lends FSDP its all-gather output from a region of the group's file (one ``allocate`` per
    all-gather). ``shared=False``: gloo's all-gather, into a buffer allocated without the
    deterministic fill."""

    def __init__(self, group: dist.ProcessGroup, shared: bool = True):
        self.group, self.shared = group, shared
        self._lent: torch.Tensor | None = None
        self.counts = {"in_place": 0, "gloo": 0}  # shared: all-gathers done each way

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = _numel(size)
        if self.shared and device.type == "cpu" and numel % self.group.size() == 0:
            lent = _arena(self.group, "all_gather").lend(numel // self.group.size() * dtype.itemsize, dtype, numel)
            if lent is not None:
                self._lent = lent
                return lent.view(*size)
        return empty_unfilled(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        lent, self._lent = self._lent, None
        if not self.shared:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        arena = _arena(group, "all_gather")
        if lent is not None:
            n = input_tensor.numel()
            own = lent.data_ptr() + arena.rank * n * lent.element_size()
            if not (output_tensor.data_ptr() == lent.data_ptr() and output_tensor.numel() == lent.numel() == n * arena.size
                    and input_tensor.data_ptr() == own and input_tensor.is_contiguous()):
                # Every rank must take the same path; FSDP's in-place all-gather is what makes it no copy.
                raise RuntimeError("cpu_collectives=shm: FSDP's all-gather did not use the output it allocated "
                                   "in place (an FSDP this comm does not know); use launch.cpu_collectives=gloo")
            arena.exchange(arena.barrier)  # the barrier is the whole collective: the shards are in place
            self.counts["in_place"] += 1
        elif arena.masks is not None and not arena.disabled:
            # Every region was held at the last exchange (or this output is not one FSDP allocated here).
            arena.exchange(lambda: dist.all_gather_into_tensor(output_tensor, input_tensor, group=group))
            self.counts["gloo"] += 1
        else:
            self.counts["gloo"] += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return _done_work() if async_op else None


class ShmReduceScatter(ReduceScatter):
    """Lends FSDP the rank's slot as its reduce-scatter input (one ``allocate`` per reduce-scatter).
    ``shared=False``: gloo's reduce-scatter, with buffers allocated without the deterministic fill.

    A one-rank shard group (single, DDP) never calls the collective: FSDP copies its input buffer
    (the gradients cast to the reduce dtype) into its output buffer, which becomes the sharded
    gradients. There the output is the input itself, so that copy finds one tensor on both sides and
    does nothing (bf16 dense_small: one pass of 4 + 4 bytes over all 60M gradients a step)."""

    def __init__(self, group: dist.ProcessGroup, shared: bool = True):
        self.group, self.shared = group, shared
        self._lent: torch.Tensor | None = None
        self._one_rank_input: torch.Tensor | None = None  # FSDP's last input buffer, until its output is asked

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = _numel(size)
        if self.group is not None and self.group.size() == 1:
            # FSDP allocates the input, fills it, then allocates the output of the same size, all in
            # one reduction (``end_reduce`` after each, so a reduction that raised in between cannot
            # hand its input to the next as an output: that would alias two units' gradients)
            given, self._one_rank_input = self._one_rank_input, None
            if given is not None and given.numel() == numel and given.dtype == dtype and given.device == device:
                return given.view(*size)
            self._one_rank_input = empty_unfilled(size, dtype, device)
            return self._one_rank_input
        # FSDP allocates the input first, then the (smaller) output, which must stay private memory.
        if self.shared and self._lent is None and device.type == "cpu" and numel % self.group.size() == 0:
            arena = _arena(self.group, "reduce_scatter")
            slots = arena.slots(numel * dtype.itemsize, dtype, numel)
            if slots is not None:
                self._lent = slots[arena.rank]
                return self._lent.view(*size)
        return empty_unfilled(size, dtype, device)

    def end_reduce(self) -> None:
        """Called after every FSDP gradient reduction (``distributed/fsdp.py`` wraps it)."""
        self._one_rank_input = None

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
    gathers: dict[tuple[int, bool], ShmAllGather] = {}
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
            if (id(group), flag) not in gathers:
                gathers[id(group), flag] = ShmAllGather(group, flag)
                _installed.append(gathers[id(group), flag])
            module.set_custom_all_gather(gathers[id(group), flag])
            module.set_custom_reduce_scatter(scatters.setdefault((id(group), flag), ShmReduceScatter(group, flag)))
            n += flag
    return n
