"""One training micro-step of the real worker pieces (config → mesh → model on meta → parallelize →
materialize → data → objective) under any layout, in N spawned processes, returning every
parameter's full gradient, the loss and the clipped-norm: the sharpest check that a layout
computes the gradient of one process. Used by the tensor-parallel tests."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from helpers import close_group, exit_spawned_rank, free_port


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = one_step(overrides)
        if rank == 0:
            torch.save(result, out)
    except BaseException:
        close_group(ok=False)
        raise
    exit_spawned_rank()


def one_step(overrides: list[str]) -> dict:
    """Gradients (full tensors, by our parameter names), loss and grad norm of one optimizer step's
    backward (all its micro-batches), under the already-initialised process group."""
    import torch.distributed as dist
    from hydra import compose, initialize_config_module

    from hyperpar.config import build as instantiate
    from hyperpar.config import register_configs
    from hyperpar.data.loader import DistributedBatchLoader
    from hyperpar.data.pad import pad_token_id
    from hyperpar.data.registry import DataContext
    from hyperpar.distributed.context_parallel import SequenceShard
    from hyperpar.distributed.dp_vocab import reduce_replicas
    from hyperpar.distributed.materialize import materialize
    from hyperpar.distributed.tensor_parallel import use_loss_parallel
    from hyperpar.models.param_names import canonical_name
    from hyperpar.train.objective import Objective
    from hyperpar.train.optim import clip_grad_norm

    register_configs()
    with initialize_config_module("hyperpar.conf", version_base=None):
        cfg = compose("config", overrides=overrides)
    pd = instantiate(cfg.parallel)
    pd.build_mesh("cpu")
    builder = instantiate(cfg.model)
    model = builder.spec.parallelize(builder.build_meta(), pd, cfg)
    if cfg.train.fused_head_loss:  # as the worker: a plain fp32 head runs inside the loss
        from hyperpar.models.layers.lm_head import fuse_head_loss

        fuse_head_loss(model)
    report: dict = {}
    materialize(model, torch.device("cpu"), seed=cfg.train.seed, source=builder.weight_source(), report=report)
    objective = Objective(mtp_weight=cfg.model.mtp_loss_weight, loss_parallel=use_loss_parallel(pd, cfg.train),
                          cp=SequenceShard.of(pd))
    t = cfg.train
    args = builder.args
    ctx = DataContext(seq_len=t.seq_len, seed=t.seed, num_samples=t.steps * t.global_batch_size,
                      vocab_size=getattr(args, "vocab_size", None) or args.text.vocab_size, model_args=args,
                      default_type=builder.auto_data, run_dir=tempfile.mkdtemp())
    dataset = instantiate(cfg.data, _partial_=True, _convert_="all")(context=ctx)
    dp = pd.submesh("dp")
    loader = DistributedBatchLoader.for_layout(dataset, pd, t, pad_id=pad_token_id(args))
    micro_batches = loader.next_step()

    dp_cp = pd.submesh("dp_cp")  # the ranks holding different tokens (data and sequence shards)

    def over_dp(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        if dp_cp.size() > 1:
            dist.all_reduce(x, group=dp_cp.get_group())
        return x

    targets = [objective.targets(mb["labels"], mb.get("position_ids"), mb.get("attention_mask")) for mb in micro_batches]
    totals = objective.totals(targets, len(micro_batches) * dp.size(), over_dp)
    loss_sum = torch.zeros(())
    for i, mb in enumerate(micro_batches):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP (one fp32 rank stays plain)
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with objective.context():
            out = model(**{k: v for k, v in mb.items() if k != "labels"})
            obj, parts = objective(out, targets[i], totals)
            obj.backward()
        loss_sum += parts.lm_sum
    reduce_replicas([model])  # as the trainer: HSDP's vocabulary-sharded weights (parallel.fsdp_vocab_parallel)
    norm = clip_grad_norm(list(model.parameters()), 0.0)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[canonical_name(name)] = g.detach().clone()
    return {"grads": grads, "loss": (over_dp(loss_sum) / totals.tokens).item(), "grad_norm": norm.item(),
            "load": report}


def layout_grads(overrides: list[str], world: int) -> dict:
    """``one_step`` in ``world`` fresh processes (rank 0's view; gradients are full on every rank)."""
    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp()) / "grads.pt"
    mp.spawn(_worker, args=(world, free_port(), list(overrides), str(out)), nprocs=world, join=True)
    return torch.load(out)


def max_rel_grad_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest |Δgrad| relative to max(1, |grad|) over parameters, and its name."""
    assert set(a["grads"]) == set(b["grads"]), set(a["grads"]) ^ set(b["grads"])
    worst, where = 0.0, ""
    for name, g in a["grads"].items():
        d = (g - b["grads"][name]).abs().max().item() / max(1.0, g.abs().max().item())
        if d > worst:
            worst, where = d, name
    return worst, where


def assert_same_step(ref: dict, got: dict, label: str, tol: float = 1e-5) -> None:
    """Two ``layout_grads`` results: loss, grad norm and every parameter's gradient within ``tol``
    (relative to max(1, |value|)); prints the figures under ``label``."""
    diff, where = max_rel_grad_diff(ref, got)
    print(f"{label}: loss {ref['loss']:.7f} vs {got['loss']:.7f}, grad norm {ref['grad_norm']:.6f} "
          f"vs {got['grad_norm']:.6f}, max rel grad diff {diff:.2e} ({where})")
    assert abs(ref["loss"] - got["loss"]) <= tol, label
    assert abs(ref["grad_norm"] - got["grad_norm"]) <= tol * max(1.0, ref["grad_norm"]), label
    assert diff <= tol, (label, where)


def assert_layout_matches_single(base: list[str], layout: str, world: int, tol: float = 1e-5) -> None:
    """One step under ``parallel=layout`` (``world`` processes) vs ``parallel=single``: see
    ``assert_same_step``."""
    ref = layout_grads(["parallel=single", *base], 1)
    got = layout_grads([f"parallel={layout}", *base], world)
    assert_same_step(ref, got, f"{' '.join(base)} {layout}", tol)


if __name__ == "__main__":  # python tests/layout_grads.py WORLD override...
    res = layout_grads(sys.argv[2:], int(sys.argv[1]))
    print(res["loss"], res["grad_norm"], len(res["grads"]))
