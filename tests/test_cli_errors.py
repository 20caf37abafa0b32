"""Bad input: one clear line on stderr, non-zero exit, no traceback, no worker started."""

from __future__ import annotations

import pytest
import torch

from helpers import run_cli

CASES = [
    (["parallel.tpp=2"], "Key 'tpp' not in 'ParallelConfig' (hint: did you mean parallel.tp?)"),
    (["+parallel.tpp=2"], "Key 'tpp' not in 'ParallelConfig'"),
    (["train.steps=abc"], "could not be converted to Integer"),
    (["parallel=fsdp3"], "Could not find 'parallel/fsdp3' (available:"),
    (["model.flavor=huge"], "unknown flavour 'huge' for model 'qwen3_5' (hint: known flavours: 0.8b, 27b, 4b, 9b, debug)"),
    (["parallel.world_size=3", "parallel.dp_shard=2"], "degrees do not multiply to world_size"),
    (["parallel=fsdp4", "train.global_batch_size=6"], "train.global_batch_size 6 not divisible"),
    (["parallel=tp2", "parallel.tp=3", "parallel.world_size=3"], "attention heads 4 not divisible by tp 3"),
    (["parallel=tp2", "+model.overrides.num_key_value_heads=1", "parallel.replicate_kv_heads=false"],
     "key/value heads 1 not divisible by tp 2 and parallel.replicate_kv_heads=false"),
    (["parallel=ep2_pp2", "model=qwen3_5_moe", "train.activation_checkpoint=selective"],
     "pp with ep and train.activation_checkpoint=selective not supported"),
    (["parallel.world_size=2", "parallel.dp_shard=2", "parallel.ep=2"], "parallel.ep=2 but the model has no experts"),
    (["model.hf_path=/nonexistent/model"], "model.hf_path '/nonexistent/model' does not exist"),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line(tmp_path, args, expected):
    res = run_cli(args + [f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "error:" in lines[0] and expected in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


HINTS = [
    # a typo of a schema key, of a data type's extra key
    (["train.stepz=3"], "train.stepz", "did you mean train.steps?"),
    (["data=megatron", "data.extra.eod_mask_los=true"], "data.extra.eod_mask_los", "did you mean data.extra.eod_mask_loss?"),
    # a key the data type reads that its YAML does not list; data=auto resolved through the model
    (["model=qwen3_5", "data.extra.noise=0.1"], "data.extra.noise",
     "data.type=dummy reads it but its config does not set it: write ++data.extra.noise=..."),
    (["model=qwen3_vl_moe", "data.extra.video_fraction=0.5"], "data.extra.video_fraction",
     "data.type=vl_dummy reads it"),
    # a key another data type reads
    (["data=megatron", "data.extra.video_fraction=0.5"], "data.extra.video_fraction",
     "'video_fraction' is read by data=vl_dummy, not by data.type=megatron"),
    (["data=json", "data.extra.xyz=1"], "data.extra.xyz", "data.type=json reads the extra keys: add_eos"),
    # a new key of a free-form mapping; a top-level key nothing has
    (["model.overrides.vocab_size=100"], "model.overrides.vocab_size", "write ++model.overrides.vocab_size=..."),
    (["foo=1"], "foo", "the config has: model, parallel, data"),
]


@pytest.mark.parametrize("overrides,key,hint", HINTS, ids=[" ".join(o) for o, _, _ in HINTS])
def test_unknown_key_hint(overrides, key, hint):
    from hyperpar.config_hints import unknown_key_hint

    got = unknown_key_hint(f"Could not override '{key}'. Key '{key.rsplit('.', 1)[-1]}' is not in struct", overrides)
    assert got is not None and hint in got, got


def test_unknown_key_hint_leaves_other_errors_alone():
    from hyperpar.config_hints import unknown_key_hint

    assert unknown_key_hint("Could not find 'parallel/fsdp3'", ["parallel=fsdp3"]) is None
    # the other overrides have a mistake of their own: no guess
    assert unknown_key_hint("Could not override 'train.stepz'. Key 'stepz' is not in struct",
                            ["train.stepz=3", "parallel=nope"]) is None


def test_hf_path_without_config_json(tmp_path):
    (tmp_path / "hf").mkdir()
    res = run_cli([f"model.hf_path={tmp_path}/hf", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no config.json" in lines[0], res.stderr


def test_dry_run_prints_plan_without_workers(tmp_path):
    res = run_cli(["parallel=fsdp2", "dry_run=true", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in ("dp_shard=2", "parameters", "params", "grads", "optimizer", "verdict     OK"):
        assert needle in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_dry_run_rejects_unsupported_with_verdict(tmp_path):
    res = run_cli(["parallel=pp2_zb", "train.activation_checkpoint=selective", "dry_run=true",
                   f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    assert "REJECTED: parallel.pp_schedule=zero_bubble with train.activation_checkpoint=selective not supported" in res.stdout


def test_dry_run_shows_tensor_parallel_memory(tmp_path):
    """Under fsdp_tp2 a rank holds a quarter of what TP splits and half of what it leaves whole."""
    res = run_cli(["parallel=fsdp_tp2", "dry_run=true", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "split over tp = 2" in res.stdout and "tensor par  sequence_parallel=True, loss_parallel=True" in res.stdout
    assert "verdict     OK" in res.stdout


def test_dry_run_of_heads_tp_cannot_split_is_a_verdict_not_a_traceback(tmp_path):
    """dry_run=true with tp 3 over 4 heads / 2 KV heads: the memory estimate read the tp plan, which raised
    ValueError ('2 KV heads cannot be split over tp 3') past the verdict: a traceback wall, exit 1."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from hyperpar.errors import PlanError
    from hyperpar.plan import make_plan

    cfg = OmegaConf.merge(compose_cfg(["parallel.world_size=3", "parallel.tp=3", "dry_run=true"]),
                          {"run_dir": str(tmp_path)})
    plan = make_plan(cfg, strict=False)
    assert not plan.ok and "attention heads 4 not divisible by tp 3" in plan.render()
    with pytest.raises(PlanError, match="not divisible by tp 3"):
        make_plan(cfg, strict=True)


@pytest.mark.parametrize(("layout", "extra", "root"), [
    # debug qwen3_5: embedding and head 2048 x 128 each, final norm 128
    (["parallel=fsdp2"], [], 2 * 2048 * 128 + 128),
    (["parallel=fsdp_tp2"], [], 2 * 1024 * 128 + 128),  # both vocabulary-split over tp, the norm whole
    (["parallel=fsdp2_pp2"], [], 2048 * 128 + 128),  # the embedding on the first stage, head and norm on the last
    (["parallel=tp2_pp2"], ["+model.overrides.tie_word_embeddings=true"], 1024 * 128 + 128),
    (["parallel=single"], ["+model.overrides.tie_word_embeddings=true"], 2048 * 128 + 128),  # one tensor
])
def test_dry_run_counts_the_root_unit_per_rank(tmp_path, layout, extra, root):
    """The shared-memory file and the gathered memory are sized by the largest FSDP unit, the root here:
    it was counted whole, neither split over tp nor over pipeline stages (a 27B plan with tp 8 x pp 4
    said 48 GB of /dev/shm for what is 3 GB)."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from hyperpar.plan import make_plan

    cfg = OmegaConf.merge(compose_cfg(["device=cpu", *layout, *extra]), {"run_dir": str(tmp_path)})
    plan = make_plan(cfg, strict=False)
    assert plan.ok, plan.problems
    assert plan.root_unit_params == root


def test_dry_run_gathers_a_ranks_share_of_the_routed_experts_under_ep(tmp_path):
    """Under ep each rank gathers its own 1 / ep of a block's routed experts (debug MoE: 8 experts of
    3 x 128 x 96 per layer), not all of them."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from hyperpar.plan import make_plan

    def largest(layout: str) -> float:
        cfg = OmegaConf.merge(compose_cfg(["device=cpu", "model=qwen3_5_moe", f"parallel={layout}"]), {"run_dir": str(tmp_path)})
        return make_plan(cfg, strict=False).largest_block_params

    assert largest("fsdp2") - largest("ep2") == 8 * 3 * 128 * 96 / 2


@pytest.mark.parametrize(("overrides", "name"), [
    (["parallel=single", "parallel.world_size=4", "parallel.dp_shard=4"], "single[world_size=4,dp_shard=4]"),
    (["parallel=fsdp_tp2", "parallel.world_size=8", "parallel.tp=4"], "fsdp_tp2[world_size=8,tp=4]"),
    (["parallel=fsdp_tp2", "parallel.sequence_parallel=false"], "fsdp_tp2"),  # the same degrees
    (["parallel=fsdp_tp2", "parallel.dp_shard=-1"], "fsdp_tp2"),  # -1: the same 2
    (["parallel=fsdp2", "parallel.name=mine", "parallel.world_size=4", "parallel.dp_shard=4"], "mine"),  # the user's name
])
def test_a_packaged_layout_with_changed_degrees_is_named_for_them(overrides, name):
    from helpers import compose_cfg
    from hyperpar.config import name_layout

    assert name_layout(compose_cfg(overrides)).parallel.name == name


def test_dry_run_rejects_a_device_the_run_would_refuse(tmp_path):
    """dry_run=true said 'OK: the plan is valid' for device=xyz (and device=cuda on a host without CUDA),
    which the run itself refuses before its first step."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from hyperpar.errors import ConfigError
    from hyperpar.plan import make_plan

    for device, why in (("xyz", "unknown device 'xyz'"), *([("cuda", "no CUDA device")] if not torch.cuda.is_available() else [])):
        cfg = OmegaConf.merge(compose_cfg([f"device={device}", "parallel=fsdp2", "dry_run=true"]), {"run_dir": str(tmp_path)})
        plan = make_plan(cfg, strict=False)
        assert not plan.ok and why in plan.render()
        with pytest.raises(ConfigError, match=why):
            make_plan(cfg, strict=True)
    assert make_plan(OmegaConf.merge(compose_cfg(["device=cpu", "parallel=fsdp2"]), {"run_dir": str(tmp_path)})).ok


def test_plan_refuses_more_ranks_than_visible_gpus(tmp_path, monkeypatch):
    """fsdp4 on a one-GPU host failed in set_device / NCCL with nothing about the layout; the plan now says
    how many processes the layout starts and how many devices there are (torchrun: its local share)."""
    from omegaconf import OmegaConf

    from helpers import compose_cfg
    from hyperpar.errors import ConfigError
    from hyperpar.plan import make_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = OmegaConf.merge(compose_cfg(["device=cuda", "parallel=fsdp4"]), {"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="starts 4 processes on this node, one per cuda device, but 1 cuda device is visible"):
        make_plan(cfg, strict=True)
    assert "1 cuda device is visible" in make_plan(cfg, strict=False).render()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # left over from some other launch: not ours to read
    with pytest.raises(ConfigError, match="starts 4 processes") as err:
        make_plan(cfg, strict=True)
    assert "at most 1 process per node" in err.value.hint
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun over 4 nodes, one GPU each
    monkeypatch.delenv("HYPERPAR_WORKER", raising=False)
    assert make_plan(cfg, strict=True).ok


def test_warmup_longer_than_the_run_warns(hyperpar_log):
    from hyperpar.train.lr import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    build_scheduler(opt, schedule="cosine", warmup_steps=40, total_steps=10, min_lr_ratio=0.1)
    assert any("optim.warmup_steps=40 > train.steps=10" in line and "0.25 x optim.lr" in line for line in hyperpar_log)
    hyperpar_log.clear()
    build_scheduler(opt, schedule="cosine", warmup_steps=10, total_steps=10, min_lr_ratio=0.1)  # reaches optim.lr
    assert not any("warmup" in line for line in hyperpar_log)


def test_fill_without_deterministic_warns(capsys, monkeypatch):
    from helpers import compose_cfg
    from hyperpar.config import check_values

    monkeypatch.delenv("RANK", raising=False)
    check_values(compose_cfg(["train.fill_uninitialized_memory=true", "train.deterministic=false"]))
    assert "does nothing with train.deterministic=false" in capsys.readouterr().err
    check_values(compose_cfg(["train.fill_uninitialized_memory=true"]))
    assert "fill_uninitialized_memory" not in capsys.readouterr().err


def test_float16_warns_that_there_is_no_loss_scaling(capsys, monkeypatch):
    from helpers import compose_cfg
    from hyperpar.config import check_values

    monkeypatch.delenv("RANK", raising=False)
    check_values(compose_cfg(["train.mixed_precision.param_dtype=float16"]))
    assert "no loss scaling" in capsys.readouterr().err
    check_values(compose_cfg(["train.mixed_precision.param_dtype=bfloat16"]))
    assert "loss scaling" not in capsys.readouterr().err
