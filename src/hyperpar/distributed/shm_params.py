"""FSDP units whose ranks share one host keep their parameters in one shared-memory copy.

``launch.cpu_collectives=shm`` (the default) on CPU. An FSDP2 all-gather costs two copies a rank
even through shared memory (``shm_collectives``): the rank's shards into the collective buffer, and
the whole buffer out into the unsharded parameters, in forward and again in backward. On two Intel
cores that was ~110 ms of a 2.8 s dense_small step. When every rank of a unit's shard group maps the
same file, neither copy is needed: the unit's unsharded parameters live in the file, laid out as
FSDP lays them out unsharded (each parameter's rows padded to a multiple of the group size), and each
rank's sharded parameter is a view of its own rows of it. The optimizer updates a rank's rows in
place; every other rank reads them through its unsharded view. An "all-gather" is then nothing at all.

When a rank may read rows another rank writes:
- A rank writes its rows only in the optimizer step (or when a checkpoint or weights are loaded),
  and reads the others' rows whenever its unit is unsharded.
- A barrier before every optimizer step: no rank writes rows another still reads. Every rank's
  backward is over by then anyway (its last gradient reduce-scatter needs every rank's gradients);
  the barrier also covers a unit without trainable parameters, which reduces nothing.
- A barrier after every optimizer step (``guard_optimizer``) and after a load
  (``parameters_written``): no rank reads rows before their owner's write is done, whether its next
  read comes at an unshard or from a unit that stayed unsharded.
- So two barriers a step for the weights, both where the ranks are nearly level (around the
  optimizer), where FSDP's all-gathers synchronised the ranks at every unit, forward and backward;
  an unshard is no collective at all.

Host memory is one copy of every such unit's parameters, against FSDP's shards (the same bytes)
plus each rank's unsharded copy of the units it holds gathered. A process's RSS counts the shared
pages it touched, so a rank's RSS reads higher than its own share.

Which units: an FSDP unit on CPU whose shard group has more than one rank and whose parameters are
plain tensors sharded on dim 0 that FSDP does not cast (parameters and compute in one dtype: an fp32
run). Every other unit (a 16-bit policy, one rank, CPU offload) keeps the all-gather path.

FSDP2 has no extension point for this. Two methods of FSDP's parameter group, ``unshard`` and
``wait_for_unshard``, are wrapped once per process (a group not homed here calls FSDP's own); each
homed parameter gets the file as its all-gather output and a free that keeps it. A check at every
unshard that each sharded parameter still points into the file: code that replaced a parameter's
tensor (``load_state_dict(assign=True)``, ``module.to(...)``) gets an error instead of ranks reading
rows that nobody updates.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("hyperpar")

ALIGN = 64  # bytes: every parameter's region starts cache-line aligned


class ResidentGroup:
    """One FSDP parameter group homed in a shared file: per parameter, the expected address of the
    rank's rows (checked at every unshard)."""

    def __init__(self, group: dist.ProcessGroup, rows: list[tuple[object, int]]):
        self.group = group
        self.rows = rows  # (FSDPParam, data_ptr of its rows)

    def check(self) -> None:
        for fsdp_param, ptr in self.rows:
            data = fsdp_param._sharded_param_data
            if data.numel() and data.data_ptr() != ptr:
                raise RuntimeError(
                    f"cpu_collectives=shm: the parameter {fsdp_param._param_fqn} no longer lives in the shared "
                    "memory FSDP reads it from (its tensor was replaced, e.g. load_state_dict(assign=True)); "
                    "load in place, or run with launch.cpu_collectives=gloo")


def _eligible(state_group) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPMeshInfo

    if not isinstance(state_group.mesh_info, FSDPMeshInfo) or state_group.device.type != "cpu":
        return False
    if state_group._all_gather_process_group.size() < 2 or state_group._use_post_forward_mesh:
        return False
    cast_to = state_group.mp_policy.param_dtype  # FSDP's own dtype attributes only exist after its lazy init
    for fp in state_group.fsdp_params:
        data = fp._sharded_param_data
        if (fp.fsdp_placement.dim != 0 or fp.offload_to_cpu or type(data) is not torch.Tensor
                or hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") or cast_to not in (None, data.dtype)
                or data.device.type != "cpu"):
            return False
    return True


def _param_groups(parts: Iterable[nn.Module]) -> list:
    groups = []
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                state_groups = module._get_fsdp_state()._fsdp_param_groups
                groups += [g for g in state_groups if _eligible(g)]
    return groups


def _region_bytes(fp, world: int) -> int:
    nbytes = fp.padded_sharded_param_size.numel() * world * fp._sharded_param_data.element_size()
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def home(parts: Iterable[nn.Module]) -> int:
    """Move the parameters of every eligible FSDP unit of ``parts`` into one shared file per shard
    group (after the weights are loaded, before the optimizer is built: it holds the parameters, and
    their storage changes here). Returns how many units moved; the rest keep FSDP's all-gathers."""
    from hyperpar.distributed.shm_collectives import map_shared

    by_group: dict[int, list] = {}
    for g in _param_groups(parts):
        by_group.setdefault(id(g._all_gather_process_group), []).append(g)
    n = 0
    for groups in by_group.values():
        pg = groups[0]._all_gather_process_group
        world, rank = pg.size(), pg.rank()
        total = sum(_region_bytes(fp, world) for g in groups for fp in g.fsdp_params)
        buffer = map_shared(pg, f"params{len(_homed)}", max(total, 1))
        if buffer is None:
            continue
        _install_methods()
        offset, nbytes, file = 0, 0, buffer.numpy()
        for g in groups:
            if g._all_gather_result is not None or not g.is_sharded:
                raise RuntimeError("cpu_collectives=shm: an FSDP unit was gathered while its parameters were "
                                   "moved to shared memory")
            rows = []
            for fp in g.fsdp_params:
                size = _region_bytes(fp, world)
                data = fp._sharded_param_data
                shard = data.numel()
                # a storage of its own: FSDP views the unsharded parameter at offset 0 of this storage
                flat = torch.frombuffer(file[offset:offset + size], dtype=torch.uint8).view(data.dtype)[:shard * world]
                own = flat[rank * shard:(rank + 1) * shard]
                with torch.no_grad():
                    own.copy_(data)
                fp._sharded_param_data = own
                length = fp.sharded_size[0] if fp.sharded_param._local_tensor.numel() else 0
                fp.sharded_param._local_tensor = own.view(fp.padded_sharded_param_size).narrow(0, 0, length)
                fp.all_gather_outputs = [flat]
                fp.free_unsharded_param = _keep  # the rows are the file: nothing to free
                if hasattr(fp, "_unsharded_param"):  # a view of FSDP's own buffer (``prime_unsharded_params``)
                    del fp._unsharded_param
                rows.append((fp, own.data_ptr()))
                offset += size
                nbytes += shard * world * data.element_size()
            g._hyperpar_resident = ResidentGroup(pg, rows)
            _resident_groups.append(g._hyperpar_resident)
            n += 1
        _homed.append(buffer)
        dist.barrier(group=pg)  # every rank's rows are in the file before any rank reads them
        log.info("cpu_collectives=shm: %d FSDP units keep their parameters in shared memory (%.0f MB, one copy "
                 "for the %d ranks): no all-gather copies", len(groups), nbytes / 2**20, world)
    return n


_homed: list[torch.Tensor] = []  # the files' mappings, alive as long as the job's parameters
_resident_groups: list[ResidentGroup] = []


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A barrier of every homed shard group before each of ``optimizer``'s steps (no rank writes its
    rows while another still reads them) and after it (no rank reads rows before their owner's
    write is done). Nothing where no unit was homed."""
    if _resident_groups:
        optimizer.register_step_pre_hook(lambda *_: _barrier())
        optimizer.register_step_post_hook(lambda *_: _barrier())


def parameters_written() -> None:
    """Every rank wrote its rows outside an optimizer step (a checkpoint loaded): a barrier, which
    every rank calls alike, before any rank reads them."""
    _barrier()


def _barrier() -> None:
    for pg in {id(g.group): g.group for g in _resident_groups}.values():
        dist.barrier(group=pg)


def release() -> None:
    """Forget the files (the end of a job); each stays mapped while a parameter still views it."""
    _homed.clear()
    _resident_groups.clear()


def _keep() -> None:
    pass


def _install_methods() -> None:
    """Route ``unshard`` and ``wait_for_unshard`` of homed groups around FSDP's all-gather; every
    other group calls FSDP's own (once per process)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import AllGatherResult, FSDPParamGroup

    if getattr(FSDPParamGroup, "_hyperpar_resident_methods", False):
        return
    unshard, wait_for_unshard = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard

    def resident_unshard(self, async_op: bool = False):
        res = getattr(self, "_hyperpar_resident", None)
        if res is None:
            return unshard(self, async_op)
        if self._all_gather_result is not None or self.is_unsharded:
            return
        if not self.unshard_in_backward and self._training_state == TrainingState.PRE_BACKWARD:
            return
        res.check()  # the rows were ordered where they were written (guard_optimizer, parameters_written)
        # a marker for wait_for_unshard; nothing was gathered
        self._all_gather_result = AllGatherResult(None, None, None, [], [], [])

    def resident_wait_for_unshard(self):
        if getattr(self, "_hyperpar_resident", None) is None:
            return wait_for_unshard(self)
        if not self._all_gather_result:
            return
        if self._training_state == TrainingState.FORWARD and self.comm_ctx.all_gather_state:
            self.comm_ctx.all_gather_state = None  # a previous (non-resident) unit's all-gather output
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_unsharded_param()  # a view of the file, made once
        self._to_unsharded()
        self._all_gather_result = None

    FSDPParamGroup.unshard = resident_unshard
    FSDPParamGroup.wait_for_unshard = resident_wait_for_unshard
    FSDPParamGroup._hyperpar_resident_methods = True
