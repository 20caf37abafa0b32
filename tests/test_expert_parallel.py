"""Expert parallelism: the dispatch/combine against one process, plan errors, and N-process training
through the real CLI equal to one process (per-step loss, aux loss and grad norm within 1e-5), with
checkpoints crossing between ep and single in both directions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import cli_metrics_shared, cli_small, close_group, exit_spawned_rank, free_port, strict_steps

TOL = 1e-5
CKPT3 = ["checkpoint=default", "checkpoint.save_steps=3", "checkpoint.keep_last=0"]
STEPS = 6
MODELS = {
    # the MTP head trained too (its decoder layer is a MoE layer under EP as well)
    "qwen3_5_moe": ["model=qwen3_5_moe", "model.mtp_loss_weight=0.3", "metrics.route_counts=true"],
    # images and videos (half the samples hold a video) on rows long enough to carry both
    "qwen3_vl_moe": ["model=qwen3_vl_moe", "data=vl_dummy", "data.extra.video_fraction=0.5", "train.seq_len=32",
                     "metrics.route_counts=true"],
}


def worst(a: dict[int, dict], b: dict[int, dict], key: str) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s][key] - b[s][key]) for s in a)


def run(run_dir: Path, overrides: list[str]) -> dict[int, dict]:
    return cli_metrics_shared(run_dir, overrides, steps=STEPS)


# ---- one process: the dispatch permutation ----------------------------------------------------------


def test_regroup_orders_arrivals_by_local_expert():
    from hyperpar.distributed.expert_parallel import _regroup

    # 3 source ranks, 2 local experts; recv[s, e] rows; arrival order is (s, e) blocks
    recv = torch.tensor([[2, 0], [1, 3], [0, 1]])
    labels = [(s, e) for s in range(3) for e in range(2) for _ in range(int(recv[s, e]))]
    order, inv = _regroup(recv)
    got = [labels[i] for i in order.tolist()]
    assert got == sorted(got, key=lambda se: (se[1], se[0]))  # expert-major, source order kept
    assert torch.equal(order[inv], torch.arange(len(labels)))


@pytest.mark.parametrize("layout, message", [
    (dict(world_size=4, dp_shard=2, tp=2, ep=4), "ep 4 must divide dp_shard*cp = 2"),
    (dict(world_size=3, dp_shard=3, ep=2), "ep 2 must divide dp_shard*cp = 3"),
])
def test_ep_layout_errors(layout, message):
    from hyperpar.distributed.parallel_dims import ParallelDims
    from hyperpar.errors import PlanError

    with pytest.raises(PlanError, match=message.replace("*", r"\*")):
        ParallelDims(**layout)


@pytest.mark.parametrize("geometry, message", [
    ({"num_experts": 6}, "experts 6 not divisible by ep 4"),
    ({"num_attention_heads": 4}, "parallel.ep=4 but the model has no experts"),
])
def test_ep_model_errors(geometry, message):
    from hyperpar.distributed.parallel_dims import ParallelDims
    from hyperpar.errors import PlanError

    pd = ParallelDims(world_size=4, dp_shard=4, ep=4)
    assert "ep" not in pd.unsupported()
    with pytest.raises(PlanError, match=message):
        pd.check_model(geometry, global_batch_size=4, micro_batch_size=1)


def test_ep_on_a_model_whose_layers_are_all_dense_is_a_plan_error():
    """Qwen3-VL-MoE with every layer in mlp_only_layers has num_experts in its config but no MoE block: the
    plan passed ep 2 and every worker crashed with a traceback."""
    from hyperpar.distributed.parallel_dims import ParallelDims
    from hyperpar.errors import PlanError
    from hyperpar.models.build import ModelBuilder

    layers = ModelBuilder("qwen3_vl_moe").geometry()["num_hidden_layers"]
    geometry = ModelBuilder("qwen3_vl_moe", overrides={"mlp_only_layers": list(range(layers))}).geometry()
    assert geometry["num_experts"] == 0
    with pytest.raises(PlanError, match="parallel.ep=2 but the model has no experts"):
        ParallelDims(world_size=2, dp_shard=2, ep=2).check_model(geometry, global_batch_size=2, micro_batch_size=1)
    assert ModelBuilder("qwen3_vl_moe", overrides={"mlp_only_layers": [0]}).geometry()["num_experts"] == 8


def test_a_pipeline_stage_without_moe_blocks_is_left_as_it_is():
    """ep 2 x pp 2 on Qwen3-VL-MoE with mlp_only_layers=[0, 1]: stage 0 holds dense layers only and its workers
    crashed ('parallel.ep > 1 on a model without routed experts'); it has nothing to split (trained by hand:
    per-step loss equal to single's)."""
    from types import SimpleNamespace

    from hyperpar.distributed.expert_parallel import apply_expert_parallel

    stage = torch.nn.Sequential(torch.nn.Linear(4, 4))
    dims = SimpleNamespace(ep=2, ep_mesh=lambda: None)
    assert apply_expert_parallel(stage, dims) is stage


# ---- two processes: one MoE block under ep 2 equals the block on one process ----------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _block_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from hyperpar.distributed.expert_parallel import apply_expert_parallel
    from hyperpar.distributed.parallel_dims import ParallelDims
    from hyperpar.models.layers.moe import SparseMoeBlock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        H, E, k, Ie = 16, 4, 2, 8

        def block() -> SparseMoeBlock:
            torch.manual_seed(0)
            b = SparseMoeBlock(H, E, k, Ie)
            with torch.no_grad():
                for p in b.parameters():
                    p.copy_(torch.randn(p.shape) * 0.3)
                b.gate.weight[0].add_(3.0)  # skewed routing: expert 0 gets far more rows than the others
            return b

        xs = [torch.randn(2, 5 + 3 * r, H, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
        ref = block()
        ref_out = [ref(x.clone().requires_grad_()) for x in xs]
        sum(o.square().sum() for o in ref_out).backward()  # one process seeing every rank's tokens

        pd = ParallelDims(world_size=world, dp_shard=world, ep=world)
        pd.build_mesh("cpu")
        ep = apply_expert_parallel(block(), pd)
        x = xs[rank].clone().requires_grad_()
        out = ep(x)
        out.square().sum().backward()
        local = ep.experts.gate_proj.to_local()
        report = {
            "local_experts": local.shape[0],
            "out": (out - ref_out[rank]).abs().max().item(),
            # expert grads (relative: sums of many rows): this rank's experts received every rank's rows
            "expert_grad": max(rel(getattr(ep.experts, n).grad.to_local(), getattr(ref.experts, n).grad.chunk(world)[rank])
                               for n in ("gate_proj", "up_proj", "down_proj")),
            # router grads are per rank (summed over ranks by data parallelism)
            "router_grad_sum": None,
        }
        g = ep.gate.weight.grad.clone()
        dist.all_reduce(g)
        report["router_grad_sum"] = rel(g, ref.gate.weight.grad)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    except BaseException:
        close_group(ok=False)
        raise
    exit_spawned_rank()


def test_moe_block_under_ep2_equals_one_process(tmp_path):
    """Skewed routing (one expert takes most rows, others few or none), unequal token counts per
    rank: forward and every gradient equal one process; each rank holds E / ep experts."""
    import torch.multiprocessing as mp

    mp.spawn(_block_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep["local_experts"] == 2
        assert rep["out"] <= 1e-6 and rep["expert_grad"] <= 1e-6 and rep["router_grad_sum"] <= 1e-6, rep


# ---- the real CLI: ep 2 equals single, checkpoints cross in both directions ------------------------------


def check_parity(single: dict[int, dict], got: dict[int, dict], what: str) -> None:
    """Loss and aux loss per step within 1e-5; the grad norm (clipping over the dense and the expert
    meshes, one all-reduce) within 1e-4 of its ~3-5 magnitude."""
    strict = strict_steps(single, got)  # MoE: up to a near-tied token's route (none in these runs so far)
    assert strict, "routes part at step 1"
    diffs = {key: worst({s: single[s] for s in strict}, {s: got[s] for s in strict}, key)
             for key in ("loss", "aux_loss", "grad_norm")}
    print(f"{what} vs single, max per-step diff over steps {strict[0]}-{strict[-1]}:", diffs)
    assert diffs["loss"] <= TOL and diffs["aux_loss"] <= TOL and diffs["grad_norm"] <= 1e-4, diffs
    assert worst(single, got, "loss") <= 2e-2
    # the routers chose alike: route_hash counts each choice once, whatever the layout (tp replicas too)
    assert all(single[s]["route_hash"] == got[s]["route_hash"] for s in strict)
    assert single[1]["loss"] != single[STEPS]["loss"]  # the weights moved: equal losses are not a stuck run


@pytest.mark.parametrize("model", [m if m == "qwen3_5_moe" else pytest.param(m, marks=pytest.mark.full)
                                   for m in sorted(MODELS)])
def test_ep2_matches_single(tmp_path, model):
    """single vs ep2 (dp_shard 2, 4 of the 8 debug experts per rank) through the real CLI."""
    extra = MODELS[model]
    check_parity(run(tmp_path / "single", [*extra, "parallel=single"]), run(tmp_path / "ep2", [*extra, "parallel=ep2"]),
                 f"{model} ep2")


def test_ep2_selective_activation_checkpoint_matches_single(tmp_path):
    """Selective AC under ep: the experts are an FSDP unit inside each checkpointed block, whose hooks
    open record_function ranges a different number of times in forward and recompute (it crashed:
    "profiler._record_function_enter_new ... invocation index 3 ... not found in storage")."""
    extra = MODELS["qwen3_5_moe"]
    check_parity(run(tmp_path / "single", [*extra, "parallel=single"]),
                 run(tmp_path / "ep2_sel", [*extra, "parallel=ep2", "train.activation_checkpoint=selective"]),
                 "qwen3_5_moe ep2 selective AC")


@pytest.mark.slow
@pytest.mark.parametrize("model", [m if m == "qwen3_5_moe" else pytest.param(m, marks=pytest.mark.full)
                                   for m in sorted(MODELS)])
def test_checkpoints_cross_between_ep2_and_single(tmp_path, model):
    """A single checkpoint resumes under ep2 and an ep2 one under single (DCP reshards the experts):
    steps 4-6 within 1e-5 of the uninterrupted single run."""
    extra = MODELS[model]
    single = run(tmp_path / "single", [*extra, "parallel=single", *CKPT3])
    run(tmp_path / "ep2", [*extra, "parallel=ep2", *CKPT3])
    resumed = {}
    for layout, source in (("ep2", "single"), ("single", "ep2")):
        step3 = tmp_path / source / "checkpoints" / "step_3"
        got = run(tmp_path / f"{layout}_from_{source}", [*extra, f"parallel={layout}", "checkpoint=default",
                                                          f"checkpoint.load_path={step3}"])
        assert sorted(got) == [4, 5, 6]
        ref = {s: single[s] for s in got}
        strict = strict_steps(ref, got)  # MoE: up to a near-tied token's route
        assert strict, "routes part at step 4"
        resumed[layout] = {key: worst({s: got[s] for s in strict}, {s: ref[s] for s in strict}, key)
                           for key in ("loss", "aux_loss")}
    print(f"{model} resumed across ep2/single vs uninterrupted single:", resumed)
    assert all(v <= TOL for d in resumed.values() for v in d.values()), resumed


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), [
    ("qwen3_5_moe", "fsdp2_tp2_ep2"),  # one of each axis in the default run; the rest with -m full
    pytest.param("qwen3_5_moe", "fsdp4_ep2", marks=pytest.mark.full),
    pytest.param("qwen3_vl_moe", "fsdp4_ep2", marks=pytest.mark.full),
    pytest.param("qwen3_vl_moe", "fsdp2_tp2_ep2", marks=pytest.mark.full),
])
def test_four_rank_ep_layouts_match_single(tmp_path, model, layout):
    """dp_shard 4 x ep 2 (experts FSDP-sharded over the 2 ranks left) and dp_shard 2 x tp 2 x ep 2
    (experts TP-sharded inside each EP group): loss and aux loss per step within 1e-5 of single."""
    extra = MODELS[model]
    check_parity(run(tmp_path / "single", [*extra, "parallel=single"]), run(tmp_path / layout, [*extra, f"parallel={layout}"]),
                 f"{model} {layout}")
