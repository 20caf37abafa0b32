"""FSDP's all-gathers and reduce-scatters through shared memory (launch.cpu_collectives=shm).

Two spawned jobs: FSDP training through the shared-memory comms equals gloo bitwise at two ranks
(and the comms really ran, and left nothing in /dev/shm); at three ranks the collectives
themselves against exact references (padding, AVG, async callers, a larger unit growing the file,
an input FSDP did not take from ``allocate``), and the two ways a group keeps gloo (no room in
/dev/shm; ranks that do not share one /dev/shm)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import close_group, exit_spawned_rank, free_port


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _shm_files() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("hyperpar-"))


def _job(rank: int, world: int, port: int, out_dir: str, body) -> None:
    """A spawned rank: ``body(rank, world)`` returns the report this rank writes."""
    _init(rank, world, port)
    try:
        report = body(rank, world)
        report["files"] = _shm_files()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    except BaseException:
        close_group(ok=False)
        raise
    exit_spawned_rank()


def _spawn(body, world: int, out_dir: Path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_job, args=(world, free_port(), str(out_dir), body), nprocs=world, join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _train(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperpar.distributed import shm_collectives as sc
    from hyperpar.distributed.fsdp import apply_fsdp

    def train(shm: bool, param_dtype: torch.dtype) -> tuple[list[float], list[torch.Tensor], int]:
        torch.manual_seed(0)
        # 257 rows: FSDP pads every shard; an embedding-sized root parameter makes one unit larger
        model = nn.Sequential(nn.Linear(257, 257, bias=False),
                              *[nn.Sequential(nn.Linear(257, 129), nn.GELU(), nn.Linear(129, 257)) for _ in range(3)])
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "dp_shard"))
        apply_fsdp(model, list(model)[1:], mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
        sc.release()  # the previous run's comms and arenas: the counts below are this run's
        units = sc.install([model]) if shm else 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1 + rank)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 257, generator=gen)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.full_tensor().clone() for p in model.parameters()], units, sc.gather_counts()

    report = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gloo, shm = train(False, dtype), train(True, dtype)
        report[name] = {"units": shm[2], "gathers": shm[3], "losses_equal": gloo[0] == shm[0],
                        "params_equal": all(torch.equal(a, b) for a, b in zip(gloo[1], shm[1]))}
    report["arenas"] = sorted({a.label.rstrip("0123456789") for a in sc._arenas.values() if a.buffer is not None})
    return report


def test_fsdp_through_shared_memory_equals_gloo_bitwise(tmp_path):
    for r, rep in enumerate(_spawn(_train, 2, tmp_path)):
        for dtype in ("fp32", "bf16"):
            gathers = rep[dtype].pop("gathers")
            assert rep[dtype] == {"units": 4, "losses_equal": True, "params_equal": True}, (r, dtype, rep)
            # FSDP's all-gathers all happened in place in the file (three regions cover what it holds):
            # per step the root and 3 blocks in forward, the first 2 blocks again in backward (the
            # root and the last block stay gathered from forward to backward)
            assert gathers == {"in_place": 3 * 6, "gloo": 0}, (r, dtype, gathers)
        assert rep["arenas"] == ["all_gather", "reduce_scatter"], rep  # the comms ran
        assert rep["files"] == [], rep  # unlinked once mapped


def _one_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperpar.distributed import shm_collectives as sc
    from hyperpar.distributed.fsdp import apply_fsdp

    pairs = []  # the data pointers of the reduce comm's allocations, in order
    real = sc.ShmReduceScatter.allocate

    def train(installed: bool, accumulate: int) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(65, 65, bias=False),
                              *[nn.Sequential(nn.Linear(65, 33), nn.GELU(), nn.Linear(33, 65)) for _ in range(2)])
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        apply_fsdp(model, list(model)[1:], mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sc.release()
        if installed:
            sc.install([model], shared=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            for _ in range(accumulate):  # FSDP reduces every micro-batch and adds to the sharded gradient
                loss = model(torch.randn(4, 65, generator=gen)).float().square().mean()
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses, [p.full_tensor().clone() for p in model.parameters()]

    def allocate(self, *a, **k):
        out = real(self, *a, **k)
        pairs.append(out.data_ptr())
        return out

    sc.ShmReduceScatter.allocate = allocate
    report = {}
    for accumulate in (1, 2):
        pairs.clear()
        ref, got = train(False, accumulate), train(True, accumulate)
        report[f"equal{accumulate}"] = ref[0] == got[0] and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        # 3 units x 3 steps x accumulate reductions, each an (input, output) pair on one buffer
        report[f"pairs{accumulate}"] = [len(pairs), all(i == o for i, o in zip(pairs[::2], pairs[1::2])),
                                        len(set(pairs[::2])) > 1]
    return report


def test_one_rank_reduce_output_is_its_input(tmp_path):
    """single / DDP (a one-rank shard group) under a 16-bit policy: FSDP's copy from its reduce input
    to its output finds one buffer on both sides, and training is bitwise what FSDP's own buffers
    give, with and without gradient accumulation."""
    (rep,) = _spawn(_one_rank, 1, tmp_path)
    assert rep.pop("files") == []
    assert rep == {"equal1": True, "pairs1": [2 * 9, True, True], "equal2": True, "pairs2": [2 * 18, True, True]}, rep


def _unshard_fills(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from hyperpar.distributed.fsdp import apply_fsdp

    torch.use_deterministic_algorithms(True)  # train.deterministic: NaN-fills every new tensor
    model = nn.Sequential(nn.Linear(65, 65, bias=False), nn.Sequential(nn.Linear(65, 33), nn.Linear(33, 65)))
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    apply_fsdp(model, [model[1]], mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    with torch.profiler.profile() as prof:
        for unit in units:
            unit.unshard()  # the 16-bit casts of every parameter
            unit.reshard()
    fills = [e for e in prof.events() if e.name == "aten::fill_"]
    with torch.profiler.profile() as prof:  # the reduction's copy-in of the 16-bit gradients
        model(torch.randn(4, 65)).float().sum().backward()

    def in_reduce(e) -> bool:
        while e is not None:
            if e.name.startswith("FSDP::post_backward"):
                return True
            e = e.cpu_parent
        return False

    reduce_fills = [e for e in prof.events() if e.name == "aten::fill_" and in_reduce(e)]
    reductions = [e for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")]
    probe = torch.empty(1000)  # the fill is still on outside FSDP's unshard
    return {"units": len(units), "fills": len(fills), "reductions": len(reductions),
            "reduce_fills": len(reduce_fills), "probe_nan": bool(probe.isnan().all())}


def test_fsdp_unshard_and_reduce_skip_the_deterministic_fill(tmp_path):
    """A 16-bit policy casts every fp32 shard into a fresh tensor per unshard, and every reduction
    copies the 16-bit gradients into an fp32 temporary, each written whole: no NaN fill of
    train.deterministic there (it stays on elsewhere)."""
    (rep,) = _spawn(_unshard_fills, 1, tmp_path)
    assert rep == {"units": 2, "fills": 0, "reductions": 2, "reduce_fills": 0, "probe_nan": True, "files": []}, rep


def _collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from hyperpar.distributed import shm_collectives as sc

    report: dict = {}
    group = dist.new_group(list(range(world)))
    gather, scatter = sc.ShmAllGather(group), sc.ShmReduceScatter(group)
    cpu = torch.device("cpu")

    def rank_data(k: int, n: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * n + k)).to(dtype)

    def everyone(n: int, dtype=torch.float32) -> torch.Tensor:
        return torch.cat([rank_data(k, n, dtype) for k in range(world)])

    def fsdp_gather(comm, n: int, dtype=torch.float32, g=group, async_op=False) -> tuple[torch.Tensor, bool]:
        """As FSDP all-gathers: allocate the output, copy the shard into the rank's chunk of it, call."""
        out = comm.allocate((n * world,), dtype=dtype, device=cpu)
        inp = out.narrow(0, rank * n, n)
        inp.copy_(rank_data(rank, n, dtype))
        work = comm(out, inp, g, async_op=async_op)
        assert (work is None) != async_op and (not async_op or work.wait())
        views = sc._arena(g, "all_gather").views
        return out, any(out.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for v in views)

    # all-gather: an odd size (slots are whole MiB), bf16, then a larger one (the file grows), async
    for n, dtype in ((1001, torch.float32), (777, torch.bfloat16), (300_001, torch.float32), (5, torch.float32)):
        out, lent = fsdp_gather(gather, n, dtype, async_op=n == 5)
        report[f"ag_{n}"] = [lent, torch.equal(out, everyone(n, dtype))]
    del out
    # outputs FSDP keeps are never overwritten: with three held, the next all-gather goes through gloo,
    # and once they are freed the regions are lent again
    held = [fsdp_gather(gather, 1000 + i) for i in range(3)]
    extra, extra_lent = fsdp_gather(gather, 999)
    report["ag_held"] = [[lent for _, lent in held], extra_lent,
                         all(torch.equal(out, everyone(1000 + i)) for i, (out, _) in enumerate(held)),
                         torch.equal(extra, everyone(999))]
    del held, extra
    fsdp_gather(gather, 10)  # the exchange of this (gloo) one sees the regions free again
    again, again_lent = fsdp_gather(gather, 998)
    report["ag_freed"] = [again_lent, torch.equal(again, everyone(998))]
    del again
    # an input that is not the allocated output's own chunk: every rank refuses alike
    out = gather.allocate((7 * world,), dtype=torch.float32, device=cpu)
    try:
        gather(out, rank_data(rank, 7), group)
        report["ag_foreign_input"] = "no error"
    except RuntimeError as exc:
        report["ag_foreign_input"] = "in place" in str(exc)
    del out

    # reduce-scatter: the input FSDP got from allocate (the rank's slot) and a private one; SUM and AVG
    def expected(n: int, op) -> torch.Tensor:
        parts = [rank_data(k, n * world)[rank * n:(rank + 1) * n] for k in range(world)]
        total = parts[0] + parts[1]
        for p in parts[2:]:
            total = total + p
        return total / world if op == dist.ReduceOp.AVG else total

    for n, op, lend in ((1000, dist.ReduceOp.SUM, True), (1000, dist.ReduceOp.AVG, True),
                        (70_000, dist.ReduceOp.SUM, False), (333, dist.ReduceOp.SUM, True)):
        if lend:
            inp = scatter.allocate((n * world,), dtype=torch.float32, device=torch.device("cpu"))
            inp.copy_(rank_data(rank, n * world))
            out = scatter.allocate((n,), dtype=torch.float32, device=torch.device("cpu"))  # FSDP's order
        else:
            inp, out = rank_data(rank, n * world), torch.empty(n)
        shared = inp.untyped_storage().data_ptr() == scatter_arena_ptr(sc, group)
        scatter(out, inp, group, op)
        report[f"rs_{n}_{op}_{lend}"] = [shared, torch.equal(out, expected(n, op))]

    # a group whose /dev/shm cannot take the file keeps gloo, with the same results
    sc.SHM_DIR = "/nonexistent-hyperpar-shm"
    small = dist.new_group(list(range(world)))
    out, lent = fsdp_gather(sc.ShmAllGather(small), 1001, g=small)
    report["no_room"] = [sc._arena(small, "all_gather").disabled, not lent, torch.equal(out, everyone(1001))]
    sc.SHM_DIR = "/dev/shm"

    # ranks on several hosts keep gloo too: rank 1 does not see rank 0's file, and rank 2 maps a
    # file of its own; neither leaves a file behind
    real_exists, real_from_file = os.path.exists, torch.from_file
    for case in ("no_file", "own_file"):
        if rank == 1 and case == "no_file":
            sc.os.path.exists = lambda path: False if "hyperpar-" in str(path) else real_exists(path)
        if rank == 2 and case == "own_file":
            sc.torch.from_file = lambda *a, **k: torch.zeros(k["size"], dtype=torch.uint8)
        hosts = dist.new_group(list(range(world)))
        out, lent = fsdp_gather(sc.ShmAllGather(hosts), 1001, g=hosts)
        sc.os.path.exists, sc.torch.from_file = real_exists, real_from_file
        report[f"several_hosts_{case}"] = [sc._arena(hosts, "all_gather").disabled, not lent,
                                           torch.equal(out, everyone(1001))]
    return report


def scatter_arena_ptr(sc, group) -> int:
    arena = sc._arena(group, "reduce_scatter")
    return -1 if arena.buffer is None else arena.buffer.untyped_storage().data_ptr()


def test_shared_memory_collectives_at_three_ranks(tmp_path):
    for r, rep in enumerate(_spawn(_collectives, 3, tmp_path)):
        files = rep.pop("files")
        assert files == [], rep
        lent = {k: v for k, v in rep.items() if k.startswith("rs_")}
        for key, (shared, equal) in lent.items():
            assert equal, (r, key)
            assert shared == key.endswith("True"), (r, key)  # allocate lent the slot; a private input was copied
        for key in ("ag_1001", "ag_777", "ag_300001", "ag_5"):
            assert rep[key] == [True, True], (r, key, rep)  # lent from the file, and right
        assert rep["ag_held"] == [[True, True, True], False, True, True], (r, rep)
        assert rep["ag_freed"] == [True, True], (r, rep)
        assert rep["ag_foreign_input"] is True, (r, rep)
        for key in ("no_room", "several_hosts_no_file", "several_hosts_own_file"):
            assert rep[key] == [True, True, True], (r, key, rep)


def test_collective_buffers_skip_the_deterministic_fill(monkeypatch):
    """FSDP's collective buffers are overwritten whole, so they skip train.deterministic's NaN fill
    (~90 ms per 128 MB on one CPU thread); the fill stays on for everything else."""
    from torch.utils import deterministic

    from hyperpar.distributed import shm_collectives as sc

    seen = []
    real = torch.empty
    monkeypatch.setattr(sc.torch, "empty", lambda *a, **k: seen.append(deterministic.fill_uninitialized_memory) or real(*a, **k))
    assert deterministic.fill_uninitialized_memory is True
    gather = sc.ShmAllGather(None, shared=False)
    out = gather.allocate((1000,), dtype=torch.float32, device=torch.device("cpu"))
    assert out.shape == (1000,) and seen == [False]
    assert deterministic.fill_uninitialized_memory is True


def test_one_rank_pairing_ends_with_each_reduction():
    """The one-rank reduce hands FSDP's input buffer back as its output within one reduction only: a
    reduction that raised between the two allocations must not pass its input to the next one as
    that one's output (two units' gradients would share storage). FSDP's reduction always ends it."""
    import types

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from hyperpar.distributed import shm_collectives as sc
    from hyperpar.distributed.fsdp import _unshard_unfilled

    one = types.SimpleNamespace(size=lambda: 1)
    comm, cpu = sc.ShmReduceScatter(one, shared=False), torch.device("cpu")
    given = comm.allocate((8,), dtype=torch.float32, device=cpu)
    assert comm.allocate((8,), dtype=torch.float32, device=cpu).data_ptr() == given.data_ptr()
    stale = comm.allocate((8,), dtype=torch.float32, device=cpu)  # its reduction raises here
    _unshard_unfilled()
    group = types.SimpleNamespace(_reduce_scatter_comm=comm)  # not a real group: post_backward raises
    with pytest.raises(Exception):
        FSDPParamGroup.post_backward(group)
    given = comm.allocate((8,), dtype=torch.float32, device=cpu)
    assert given.data_ptr() != stale.data_ptr()
    assert comm.allocate((8,), dtype=torch.float32, device=cpu).data_ptr() == given.data_ptr()


def _resident(rank: int, world: int) -> dict:
    """The same training four ways: gloo, the shared-memory collectives, and the parameters homed
    in shared memory (fp32; and a 16-bit policy, which keeps the all-gathers)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperpar.distributed import shm_collectives as sc
    from hyperpar.distributed import shm_params as sp
    from hyperpar.distributed.fsdp import apply_fsdp, prime_unsharded_params

    barriers = []
    real_barrier = dist.barrier
    dist.barrier = lambda *a, **k: barriers.append(1) or real_barrier(*a, **k)

    def train(mode: str, param_dtype: torch.dtype = torch.float32) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(257, 257, bias=False),
                              *[nn.Sequential(nn.Linear(257, 129), nn.GELU(), nn.Linear(129, 257)) for _ in range(3)])
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "dp_shard"))
        apply_fsdp(model, list(model)[1:], mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
        sc.release()
        sp.release()
        if mode != "gloo":
            sc.install([model])
        homed = sp.home([model]) if mode == "homed" else 0  # the launcher's order: no all-gather before
        prime_unsharded_params(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sp.guard_optimizer(opt)
        gen = torch.Generator().manual_seed(1 + rank)
        losses, per_step = [], []
        for _ in range(3):
            barriers.clear()
            loss = model(torch.randn(4, 257, generator=gen)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            per_step.append(len(barriers))
        # each rank's sharded rows are its rows of the unsharded parameter, in one file
        model[1].unshard()
        fp = model[1]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        rows = fp._sharded_param_data.data_ptr() == model[1][0].weight.data_ptr() + rank * fp._sharded_param_data.nbytes
        model[1].reshard()
        return {"losses": losses, "params": [p.full_tensor().clone() for p in model.parameters()], "homed": homed,
                "gathers": sc.gather_counts(), "barriers": per_step, "rows": rows}

    gloo, shm, homed, bf16 = train("gloo"), train("shm"), train("homed"), train("homed", torch.bfloat16)
    report = {
        "homed": [homed["homed"], bf16["homed"]],
        "equal_shm": homed["losses"] == shm["losses"] and all(torch.equal(a, b) for a, b in zip(homed["params"], shm["params"])),
        "equal_gloo": homed["losses"] == gloo["losses"] and all(torch.equal(a, b) for a, b in zip(homed["params"], gloo["params"])),
        "gathers": [homed["gathers"], bf16["gathers"]["in_place"] > 0],
        # a step: 2 barriers per reduce-scatter (4 units), 1 before the optimizer step and 1 after
        # it; an unshard is none
        "barriers": [homed["barriers"], shm["barriers"]],
        "rows": homed["rows"],
    }
    # A parameter whose tensor was replaced behind FSDP's back is an error, not stale rows
    sc.release()
    sp.release()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64)))
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "dp_shard"))
    apply_fsdp(model, [model[1]], mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    sc.install([model])
    sp.home([model])
    prime_unsharded_params(model)
    fp = model[1]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    fp._sharded_param_data = fp._sharded_param_data.clone()
    try:
        model(torch.randn(2, 64))
        report["replaced"] = "no error"
    except RuntimeError as e:
        report["replaced"] = str(e)
    dist.barrier = real_barrier
    sp.release()
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_homed_in_shared_memory_train_the_same(tmp_path, world):
    """fp32 FSDP units keep their parameters in one shared file (shm_params): no all-gather runs,
    each rank's shard is its rows of the unsharded parameter, training is bitwise that of the
    shared-memory all-gathers (and at two ranks gloo's), with two barriers for the weights a step."""
    for r, rep in enumerate(_spawn(_resident, world, tmp_path)):
        assert rep.pop("files") == [], rep
        assert rep["homed"] == [4, 0], (r, rep)  # a 16-bit policy keeps its all-gathers
        assert rep["equal_shm"], (r, rep)
        assert rep["equal_gloo"] == (world == 2), (r, rep)  # at 3 ranks the shared sum's order is its own
        assert rep["gathers"] == [{"in_place": 0, "gloo": 0}, True], (r, rep)
        # shared-memory all-gathers: 6 exchanges a step (4 units in forward, 2 again in backward)
        assert rep["barriers"] == [[10, 10, 10], [8 + 6, 8 + 6, 8 + 6]], (r, rep)
        assert rep["rows"] is True, (r, rep)
        assert "no longer lives in the shared memory" in rep["replaced"], (r, rep)
