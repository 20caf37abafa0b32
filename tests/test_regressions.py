"""Pins the bug classes that broke earlier systems: parameter leaves after meta-init, the one-rank path
wrapped like the N-rank path (and, in fp32, left plain only where that is bitwise the same),
activation checkpointing with a module shared by all layers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from helpers import close_group, compose_cfg, read_losses, records
from hyperpar.errors import TrainingError
from hyperpar.launch import worker_main


def _run(tmp_path, name, overrides):
    cfg = compose_cfg(["metrics.progress_bar=false", *overrides])
    run_dir = tmp_path / name
    run_dir.mkdir()
    worker_main(cfg, str(run_dir))
    return read_losses(run_dir)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "one_rank_cast"])
def test_one_rank_params_are_leaf_dtensors_like_n_ranks(tmp_path, fsdp):
    """Materialised parameters are leaves on a (replicate, shard) mesh even with one rank, and AdamW
    takes them; on CPU the default one-rank casts (``one_rank_cast``) keep them plain fp32 leaves."""
    import torch.distributed as dist

    from hyperpar.config import build
    from hyperpar.distributed.materialize import materialize

    cfg = compose_cfg(["train.mixed_precision.param_dtype=bfloat16", f"train.mixed_precision.one_rank_cast={not fsdp}"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pdims = build(cfg.parallel)
        pdims.build_mesh("cpu")
        builder = build(cfg.model)
        model = builder.spec.parallelize(builder.build_meta(), pdims, cfg)
        materialize(model, torch.device("cpu"), seed=0)
        assert isinstance(model, FSDPModule) == fsdp
        assert all(isinstance(m, FSDPModule) == fsdp for m in model.model.layers.values())
        for name, p in model.named_parameters():
            assert p.is_leaf and p.requires_grad, name
            assert not fsdp or isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0)), name
            assert p.dtype == torch.float32, name  # (sharded) master weights stay fp32
        opt, _ = build(cfg.optim, _partial_=True)(model=model, total_steps=2)
        ids = torch.randint(0, 100, (2, 16))
        logits = model(ids)
        assert logits.dtype == torch.bfloat16  # the mixed-precision policy is applied with one rank too
        logits.float().logsumexp(-1).mean().backward()
        opt.step()
        assert all(p.grad is not None and p.grad.dtype == p.dtype == torch.float32 for p in model.parameters())
    except BaseException:
        close_group(ok=False)
        raise
    close_group(ok=True)


def test_one_rank_fp32_stays_plain_and_equals_fsdp_bitwise(tmp_path, monkeypatch):
    """One fp32 rank skips FSDP (its wrapping there is copies only). Three steps of four accumulated
    micro-batches each, through the worker: the losses and grad norms equal those of the FSDP-wrapped
    one-rank model bit for bit, and a 16-bit policy still gets FSDP (its casts) where the CPU one-rank
    casts are off (tests/test_one_rank_cast.py has them)."""
    import torch.distributed as dist

    from hyperpar.config import build
    from hyperpar.distributed import fsdp

    def metrics(name: str) -> dict[int, dict]:
        _run(tmp_path, name, ["train.steps=3"])
        return records(tmp_path / name)  # loss, grad_norm, lr, tokens per step

    plain = metrics("plain")
    monkeypatch.setattr(fsdp, "one_rank_is_plain", lambda *a, **k: False)
    wrapped = metrics("fsdp")
    monkeypatch.undo()
    assert len(plain) == 3 and plain == wrapped, (plain, wrapped)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dtype, wrapped in (("float32", False), ("bfloat16", True)):
            cfg = compose_cfg([f"train.mixed_precision.param_dtype={dtype}", "train.mixed_precision.one_rank_cast=false"])
            pdims = build(cfg.parallel)
            pdims.build_mesh("cpu")
            builder = build(cfg.model)
            model = builder.spec.parallelize(builder.build_meta(), pdims, cfg)
            assert any(isinstance(m, FSDPModule) for m in model.modules()) == wrapped, dtype
    except BaseException:
        close_group(ok=False)
        raise
    close_group(ok=True)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpoint_matches_no_checkpoint(tmp_path, mode):
    base = _run(tmp_path, "none", ["train.steps=3"])
    ac = _run(tmp_path, mode, ["train.steps=3", f"train.activation_checkpoint={mode}"])
    assert ac == base  # recomputation is exact in fp32 on CPU


def test_non_finite_loss_stops_with_step_number(tmp_path):
    with pytest.raises(TrainingError, match=r"non-finite loss at step \d+"):
        _run(tmp_path, "nan", ["train.steps=6", "optim.lr=1e12", "train.max_grad_norm=0", "optim.warmup_steps=0"])


def test_same_seed_same_losses_and_seed_matters(tmp_path):
    a = _run(tmp_path, "a", ["train.steps=2"])
    b = _run(tmp_path, "b", ["train.steps=2"])
    c = _run(tmp_path, "c", ["train.steps=2", "train.seed=7"])
    assert a == b and a != c
    assert all(math.isfinite(v) for v in a.values())


def test_bf16_fsdp2_with_an_idle_mtp_head_and_grad_accumulation_trains(tmp_path):
    """An FSDP unit that never runs (the MTP head at weight 0) under bf16 and 2 micro-batches per rank:
    FSDP's end-of-backward callback used to fail on its never-gathered parameters."""
    from helpers import cli_small

    res = cli_small(tmp_path / "run", ["model=qwen3_5_moe", "model.mtp_loss_weight=0", "parallel=fsdp2",
                                       "train.mixed_precision.param_dtype=bfloat16", "train.global_batch_size=8",
                                       "train.micro_batch_size=2"], steps=2)
    assert res.returncode == 0, res.stderr[-3000:]


def test_mtp_on_one_token_rows_is_one_line(tmp_path):
    from helpers import cli_small, one_error_line

    res = cli_small(tmp_path / "run", ["model=qwen3_5_moe", "model.mtp_loss_weight=0.3", "train.seq_len=1"], steps=1)
    assert res.returncode == 2 and "needs train.seq_len >= 2" in one_error_line(res), res.stderr[-2000:]


def test_deterministic_run_skips_the_nan_fill_and_hands_it_back(tmp_path):
    """train.deterministic keeps deterministic kernels without PyTorch's NaN fill of every new tensor
    (train.fill_uninitialized_memory, default off: ~40 % more kernels in a GPU step); the setting is
    the caller's again after an in-process run."""
    from torch.utils import deterministic

    from helpers import PROBES, run_small

    before = deterministic.fill_uninitialized_memory
    assert before is True  # torch's default: the runs below turn it off or keep it on
    for fill in (False, True):
        run = tmp_path / str(fill)
        run_small(run, ["trainer._target_=helpers.ProbeTrainer", f"train.fill_uninitialized_memory={fill}"], steps=1)
        assert PROBES[str(run)]["deterministic"] is True
        assert PROBES[str(run)]["fill_uninitialized_memory"] is fill
        assert deterministic.fill_uninitialized_memory is before
    # a job that fails before its process group exists hands the setting back too
    from hyperpar.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown device"):
        run_small(tmp_path / "bad", ["device=xyz"], steps=1)  # sets the fill off, then fails
    assert deterministic.fill_uninitialized_memory is before
