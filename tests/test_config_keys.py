"""Every schema key does what it says: changing it changes what the program does, or is refused.

The keys come from the dataclasses of hyperpar/config.py, so a new key without an entry here (and a
row in docs/guide/config.md's table) fails ``test_every_schema_key_has_an_effect_and_a_doc_row``.
Each entry changes one key against a baseline and looks where that key acts: the driver's plan, a
tiny in-process run (metrics, logs, files, what the worker built), the dataset, the optimizer, the
launcher's settings or the CLI. "Refused" means a one-line user error that names the key or value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf

import fixtures
from fixtures import SMALL
from helpers import PROBES, REPO, compose_cfg, run_cli
from hyperpar.config import JobConfig

RUN_STEPS = 3
JSON = ["data=json", "data.cache_dir={cache}"]  # one tokenized cache for every json entry
CKPT = ["checkpoint=default", "checkpoint.save_steps=0"]


def schema_keys(cls: type = JobConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def doc_keys() -> list[str]:
    text = (REPO / "docs" / "guide" / "config.md").read_text()
    # key rows only: the config-group table above them names groups (``model/``)
    return re.findall(r"^\| `([^`/]+)` \|", text, flags=re.M)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@dataclasses.dataclass(frozen=True)
class Refused:
    message: str


class Observer:
    """Runs each distinct observation once (entries share baselines)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, Any] = {}
        (root / "cache").mkdir(parents=True, exist_ok=True)
        self.hf = root / "hf_geometry"  # a config.json-only HF directory (another geometry)
        self.hf.mkdir(exist_ok=True)
        (self.hf / "config.json").write_text(json.dumps(fixtures.qwen3_5()))
        self.vl = root / "hf_vl"  # a VL config.json for a text model group
        self.vl.mkdir(exist_ok=True)
        (self.vl / "config.json").write_text(json.dumps(fixtures.qwen3_5_moe_vl()))
        (root / "other.jsonl").write_text("".join(json.dumps({"text": f"line {i} of another corpus"}) + "\n" for i in range(40)))

    def expand(self, overrides: list[str]) -> list[str]:
        return [o.replace("{cache}", str(self.root / "cache")).replace("{root}", str(self.root))
                .replace("{hf}", str(self.hf)).replace("{vl}", str(self.vl)).replace("{export}", str(self.export())).replace("{unused}", str(self.unused()))
                for o in overrides]

    def observe(self, kind: str, overrides: list[str], env: tuple[tuple[str, str | None], ...] = ()) -> Any:
        key = (kind, tuple(overrides), env)
        if key not in self.cache:
            saved = {name: os.environ.get(name) for name, _ in env}
            try:
                for name, value in env:
                    _set_env(name, value)
                self.cache[key] = getattr(self, kind)(self.expand(overrides), len(self.cache))
            except Exception as e:  # noqa: BLE001 - a refusal; the entry checks that it names the change
                self.cache[key] = Refused(f"{type(e).__name__}: {e} {getattr(e, 'hint', '') or ''}")
            finally:
                for name, value in saved.items():
                    _set_env(name, value)
        return self.cache[key]

    def _cfg(self, overrides: list[str]):
        from hyperpar.config import check_values

        return check_values(compose_cfg(overrides), warn=False)

    # --- where keys act -------------------------------------------------------------------------
    def plan(self, overrides: list[str], n: int) -> str:
        from hyperpar.plan import make_plan

        cfg = self._cfg(overrides)
        plan = make_plan(OmegaConf.merge(cfg, {"run_dir": str(self.root / f"plan{n}")}), strict=True)
        return plan.render()

    def run(self, overrides: list[str], n: int) -> dict:
        from hyperpar.launch import run_job

        run_dir = self.root / f"run{n}"
        run_dir.mkdir()
        cfg = self._cfg(["metrics.progress_bar=false", *SMALL, f"train.steps={RUN_STEPS}",
                         "trainer._target_=helpers.ProbeTrainer", *overrides])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            run_job(cfg, str(run_dir))
            if "resume" in " ".join(overrides):  # the same command again, in the same run dir
                run_job(cfg, str(run_dir))
        return {
            "records": [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()],
            "log": (run_dir / "logs" / "rank_0.log").read_text(),
            "stderr": err.getvalue(),
            "probe": PROBES[str(run_dir)],
            "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_dir()),
            "profile": _profile_files(run_dir / "profile"),
        }

    def data(self, overrides: list[str], n: int) -> list[dict]:
        """The samples the worker would train on (the driver's data check, then the worker's build)."""
        from hyperpar.config import build
        from hyperpar.data.registry import DataContext
        from hyperpar.plan import check_data

        cfg = self._cfg(overrides)
        builder = build(cfg.model)
        default = builder.auto_data
        check_data(cfg.data, default)
        t = cfg.train
        ctx = DataContext(seq_len=t.seq_len, seed=t.seed, num_samples=t.steps * t.global_batch_size,
                          vocab_size=builder.args.vocab_size, model_args=builder.args, default_type=default,
                          run_dir=str(self.root / f"data{n}"))
        ds = build(cfg.data, _partial_=True, _convert_="all")(context=ctx)
        return [{k: v.tolist() for k, v in ds[i].items()} for i in range(4)]

    def optim(self, overrides: list[str], n: int) -> dict:
        """Three optimizer steps on a small layer with fixed gradients, and the LR of every step."""
        from hyperpar.config import build

        cfg = self._cfg(overrides)
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3)
        opt, sched = build(cfg.optim, _partial_=True)(model=layer, total_steps=cfg.train.steps)
        gen = torch.Generator().manual_seed(1)
        lrs = []
        for step in range(cfg.train.steps):
            lrs.append(opt.param_groups[0]["lr"])
            if step < 3:
                for p in layer.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            sched.step()
        return {"weights": [p.detach().tolist() for p in layer.parameters()], "lrs": lrs}

    def launcher(self, overrides: list[str], n: int) -> dict:
        """The settings our elastic launch hands to PyTorch's launcher (which is not started)."""
        import torch.distributed.launcher.api as api

        from hyperpar.launch import launch_workers

        cfg = self._cfg(["parallel=fsdp2", *overrides])
        seen = {}

        def fake_launch(lc, entry):
            seen.update(max_restarts=lc.max_restarts, monitor_interval=lc.monitor_interval, start_method=lc.start_method)
            return lambda *args: {0: {"losses": []}}

        original = api.elastic_launch
        api.elastic_launch = fake_launch
        try:
            launch_workers(cfg, str(self.root / f"launch{n}"))
        finally:
            api.elastic_launch = original
        return seen

    def parity(self, overrides: list[str], n: int) -> str:
        """A single run as the driver sees it: without +experiment=parity no report callback is attached."""
        from hyperpar.parity.callback import check_attached

        check_attached(self._cfg(overrides).parity, callbacks={})
        return "accepted"

    def cli(self, overrides: list[str], n: int) -> dict:
        run_dir = self.root / f"cli{n}"
        res = run_cli([*SMALL, "train.steps=2", *overrides, f"hydra.run.dir={run_dir}"], cwd=self.root, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(res.stderr.strip())
        return {"metrics": (run_dir / "metrics.jsonl").exists(), "stdout": res.stdout}

    def unused(self) -> Path:
        """The export plus one tensor no model reads."""
        from safetensors.torch import load_file, save_file

        out = self.root / "unused"
        if not out.exists():
            out.mkdir()
            src = self.export()
            (out / "config.json").write_text((src / "config.json").read_text())
            tensors = {}
            for f in sorted(src.glob("*.safetensors")):
                tensors.update(load_file(str(f)))
            tensors["model.not_a_module.weight"] = torch.zeros(2)
            save_file(tensors, str(out / "model.safetensors"))
        return out

    def export(self) -> Path:
        """A Hugging Face export of a trained debug model (made once, by checkpoint.export_hf_at_end)."""
        out = self.root / "exported"
        if not (out / "hf" / "config.json").exists():
            from hyperpar.launch import run_job

            cfg = self._cfg(["metrics.progress_bar=false", *SMALL, "train.steps=5", "optim.lr=0.01", *CKPT,
                             "checkpoint.export_hf_at_end=true"])
            with contextlib.redirect_stderr(io.StringIO()):
                run_job(cfg, str(out))
        return out / "hf"


def _profile_files(root: Path) -> dict[str, Any]:
    """What profile.* wrote: each file's name, the summaries' operator rows and the traces' event kinds."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*.json")) if root.is_dir() else []:
        data = json.loads(p.read_text())
        rel = str(p.relative_to(root))
        if rel.endswith(".trace.json"):
            out[rel] = sorted({str(e.get("cat")) for e in data["traceEvents"]})
        else:
            out[rel] = [sorted(op) for op in data["top_ops"]], len(data["top_ops"])
    return out


# --- checks -------------------------------------------------------------------------------------------
def losses(obs: dict) -> list[float]:
    return [r["loss"] for r in obs["records"]]


def field(name: str) -> Callable[[dict], Any]:
    return lambda obs: [r.get(name) for r in obs["records"]]


def probe(name: str) -> Callable[[dict], Any]:
    return lambda obs: obs["probe"][name]


def log_steps(obs: dict) -> list[int]:
    return [int(m) for m in re.findall(r"INFO step (\d+) loss", obs["log"])]


def has_dir(name: str) -> Callable[[dict], Any]:
    return lambda obs: any(f == name or f.startswith(name + "/") for f in obs["files"])


def in_log(text: str) -> Callable[[dict], Any]:
    return lambda obs: text in obs["log"]


def checkpoints(obs: dict) -> list[str]:
    return [f for f in obs["files"] if re.fullmatch(r"checkpoints/step_\d+", f)]


@dataclasses.dataclass(frozen=True)
class Effect:
    where: str  # Observer method
    change: list[str]
    base: list[str] = dataclasses.field(default_factory=list)
    view: Callable[[Any], Any] = lambda obs: obs  # what of the observation the key changes
    refused: str | None = None  # the change is refused with a message containing this
    may_refuse: bool = False  # the key switches between a refusal and an accepted config
    env: tuple[tuple[str, str | None], ...] = ()  # environment of both observations (None: unset)


def refused(where: str, change: list[str], match: str, base: list[str] | None = None) -> Effect:
    return Effect(where, change, base or [], refused=match)


EFFECTS: dict[str, Effect] = {
    # model
    "model._target_": refused("plan", ["model._target_=hyperpar.nope.Builder"], "hyperpar.nope"),
    "model.name": Effect("plan", ["model.name=qwen3_5_moe"]),
    "model.flavor": Effect("plan", ["model.flavor=0.8b"]),
    "model.hf_path": Effect("plan", ["model.hf_path={hf}", "model.load_weights=false"]),
    "model.load_weights": Effect("run", ["model.load_weights=false"], ["model.hf_path={export}"], view=lambda o: losses(o)[0]),
    "model.mtp_loss_weight": Effect("run", ["model.mtp_loss_weight=0.3"], ["model=qwen3_5_moe"], view=field("mtp_loss")),
    "model.default_data": Effect("run", ["model.default_data=dummy"], ["model=qwen3_5_moe_vl"], view=field("tokens")),
    "model.text_only": Effect("plan", ["model.text_only=true"], ["model=qwen3_5_moe", "model.hf_path={vl}", "model.load_weights=false"],
                              may_refuse=True),
    "model.allow_unused_weights": Effect("run", ["model.allow_unused_weights=true"], ["model.hf_path={unused}"],
                                         may_refuse=True),
    "model.num_hidden_layers": Effect("plan", ["model.num_hidden_layers=2"]),
    "model.overrides": Effect("plan", ["+model.overrides.num_hidden_layers=2"]),
    "model.experts_impl": Effect("run", ["model.experts_impl=loop"], ["model=qwen3_5_moe"], view=probe("experts_impl")),
    # parallel: the mesh in the plan, or refused (a layout that is not supported yet)
    "parallel._target_": refused("plan", ["parallel._target_=hyperpar.nope.Dims"], "hyperpar.nope"),
    "parallel.name": Effect("plan", ["parallel.name=renamed"]),
    "parallel.world_size": Effect("plan", ["parallel.world_size=2"], ["parallel.dp_shard=-1"]),
    "parallel.dp_replicate": Effect("plan", ["parallel.dp_replicate=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.dp_shard": Effect("plan", ["parallel.dp_shard=1"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.tp": Effect("plan", ["parallel.tp=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.cp": Effect("plan", ["parallel.cp=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.ep": Effect("plan", ["parallel.ep=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.pp": Effect("plan", ["parallel.pp=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.vpp": Effect("plan", ["parallel.vpp=2"], ["parallel=fsdp2"], may_refuse=True),
    "parallel.pp_schedule": refused("plan", ["parallel.pp_schedule=bogus"], "pp_schedule='bogus'"),
    "parallel.pp_layers": Effect("plan", ["parallel.pp_layers=[3,1]"], ["parallel=pp2"]),
    "parallel.sequence_parallel": Effect("plan", ["parallel.sequence_parallel=false"], ["parallel=tp2"]),
    "parallel.vision_tp": Effect("plan", ["parallel.vision_tp=true"], ["model=qwen3_vl_moe", "parallel=tp2"]),
    "parallel.fsdp_reshard_after_forward": Effect("plan", ["parallel.fsdp_reshard_after_forward=false"], ["parallel=fsdp2"]),
    "parallel.fsdp_vocab_parallel": Effect("plan", ["parallel.fsdp_vocab_parallel=true"], ["parallel=fsdp2"]),
    "parallel.replicate_kv_heads": Effect("plan", ["parallel.replicate_kv_heads=false"],
                                          ["parallel=tp2", "+model.overrides.num_key_value_heads=1"], may_refuse=True),
    # data: the samples of the type that reads the key; another type refuses it
    "data._target_": refused("data", ["data._target_=hyperpar.nope.build"], "hyperpar.nope"),
    "data.type": Effect("data", ["data.type=dummy"], ["model=qwen3_vl_moe"]),  # data=auto: vl_dummy
    "data.path": Effect("data", ["data.path={root}/other.jsonl"], JSON),
    "data.tokenizer": refused("data", ["data.tokenizer={root}/no_tokenizer"], "no_tokenizer", JSON),
    "data.prefix": refused("data", ["data.prefix=/corpus"], "data.prefix"),
    "data.blend": refused("data", ["data.blend='1 /corpus'"], "data.blend"),
    "data.text_key": refused("data", ["data.text_key=body"], "body", JSON),
    "data.pack": Effect("data", ["data.pack=false"], JSON),
    "data.cache_dir": Effect("data", ["data.cache_dir={root}/other_cache"], JSON,
                             view=lambda obs: None),  # checked by the files it writes, below
    "data.split": Effect("data", ["data.split='train[:5]'"], JSON),
    "data.shuffle": Effect("data", ["data.shuffle=false"], JSON),
    "data.chat": refused("data", ["data.chat=true"], "messages", JSON),
    "data.max_samples": Effect("data", ["data.max_samples=2"], JSON),
    "data.format": refused("data", ["data.format=parquet"], "parquet", JSON),
    "data.extra": Effect("data", ["+data.extra.noise=0.5"], ["data=dummy"]),
    # optim
    "optim._target_": refused("optim", ["optim._target_=hyperpar.nope.build"], "hyperpar.nope"),
    "optim.name": refused("optim", ["optim.name=sgd"], "sgd"),
    "optim.lr": Effect("optim", ["optim.lr=0.1"]),
    "optim.weight_decay": Effect("optim", ["optim.weight_decay=0.5"]),
    "optim.beta1": Effect("optim", ["optim.beta1=0.5"]),
    "optim.beta2": Effect("optim", ["optim.beta2=0.5"]),
    "optim.eps": Effect("optim", ["optim.eps=0.01"]),
    "optim.schedule": Effect("optim", ["optim.schedule=linear"], view=lambda o: o["lrs"]),
    "optim.warmup_steps": Effect("optim", ["optim.warmup_steps=5"], view=lambda o: o["lrs"]),
    "optim.min_lr_ratio": Effect("optim", ["optim.min_lr_ratio=0.5"], view=lambda o: o["lrs"]),
    # checkpoint
    "checkpoint._target_": refused("run", ["checkpoint._target_=hyperpar.nope.build"], "hyperpar.nope"),
    "checkpoint.enabled": Effect("run", ["checkpoint.enabled=true"], view=has_dir("checkpoints")),
    "checkpoint.save_steps": Effect("run", ["checkpoint.save_steps=1"], CKPT, view=checkpoints),
    "checkpoint.keep_last": Effect("run", ["checkpoint.keep_last=0"], [*CKPT, "checkpoint.save_steps=1"], view=checkpoints),
    "checkpoint.load_path": refused("run", ["checkpoint.load_path={root}/no_checkpoint"], "no_checkpoint", CKPT),
    "checkpoint.resume": Effect("run", ["checkpoint.resume=never"], [*CKPT, "checkpoint.resume=auto"],
                                view=in_log("resumed from")),
    "checkpoint.async_save": Effect("run", ["checkpoint.async_save=true"], CKPT, view=in_log("in the background")),
    "checkpoint.export_hf_at_end": Effect("run", ["checkpoint.export_hf_at_end=true"], CKPT, view=has_dir("hf")),
    # train
    "train.steps": Effect("run", ["train.steps=2"], view=field("step")),
    "train.seed": Effect("run", ["train.seed=7"], view=losses),
    "train.global_batch_size": Effect("run", ["train.global_batch_size=2"], view=field("tokens")),
    "train.micro_batch_size": Effect("plan", ["train.micro_batch_size=4"]),
    "train.seq_len": Effect("run", ["train.seq_len=8"], view=field("tokens")),
    "train.max_grad_norm": Effect("run", ["train.max_grad_norm=0.01"], view=losses),
    "train.mixed_precision.param_dtype": Effect("run", ["train.mixed_precision.param_dtype=bfloat16"], view=losses),
    "train.mixed_precision.reduce_dtype": Effect("run", ["train.mixed_precision.reduce_dtype=bfloat16"], view=losses),
    "train.mixed_precision.cpu_matmul": Effect("run", ["train.mixed_precision.cpu_matmul=fp32"],
                                               ["train.mixed_precision.param_dtype=bfloat16", "train.mixed_precision.cpu_matmul=native"],
                                               view=in_log("16-bit matmuls run as fp32 GEMMs")),
    # the run's numbers do not change (tests/test_one_rank_cast.py): the plan's bf16 copies do
    "train.mixed_precision.one_rank_cast": Effect("plan", ["train.mixed_precision.one_rank_cast=false"],
                                                  ["train.mixed_precision.param_dtype=bfloat16"]),
    "train.loss_parallel": Effect("plan", ["train.loss_parallel=false"], ["parallel=tp2"]),
    "train.compile": Effect("plan", ["train.compile=true"]),  # the run: tests/test_compile.py
    "train.activation_checkpoint": Effect("run", ["train.activation_checkpoint=full"], view=probe("checkpointed_blocks")),
    "train.log_every": Effect("run", ["train.log_every=2"], view=log_steps),
    "train.deterministic": Effect("run", ["train.deterministic=false"], view=probe("deterministic")),
    "train.fill_uninitialized_memory": Effect("run", ["train.fill_uninitialized_memory=true"],
                                              view=probe("fill_uninitialized_memory")),
    # the numerics: tests/test_lm_head.py and tests/test_cross_entropy.py
    "train.fused_head_loss": Effect("run", ["train.fused_head_loss=false"], view=probe("fused_heads")),
    "train.stop_after_steps": Effect("run", ["train.stop_after_steps=1"], view=field("step")),
    "train.pp_microbatches": Effect("plan", ["train.pp_microbatches=2"], ["parallel=pp2"]),
    # metrics
    "metrics.tensorboard": Effect("run", ["metrics.tensorboard=true"], view=has_dir("tb")),
    "metrics.progress_bar": Effect("run", ["metrics.progress_bar=true"], view=log_steps, env=(("HYPERPAR_NO_BAR", None),)),
    "metrics.peak_tflops": Effect("run", ["metrics.peak_tflops=0.5"], view=field("mfu")),
    "metrics.route_counts": Effect("run", ["metrics.route_counts=true"], ["model=qwen3_5_moe"], view=field("route_counts")),
    # profile: what the profiled step wrote (tests/test_profiler.py reads the files themselves)
    "profile.steps": Effect("run", ["profile.steps=[2]"], view=lambda o: sorted(o["profile"])),
    "profile.ranks": Effect("run", ["profile.ranks=[]"], ["profile.steps=[2]"], view=lambda o: sorted(o["profile"])),
    "profile.trace": Effect("run", ["profile.trace=false"], ["profile.steps=[2]"], view=lambda o: sorted(o["profile"])),
    "profile.row_limit": Effect("run", ["profile.row_limit=3"], ["profile.steps=[2]", "profile.trace=false"],
                                view=lambda o: o["profile"]),
    "profile.record_shapes": Effect("run", ["profile.record_shapes=true"], ["profile.steps=[2]", "profile.trace=false"],
                                    view=lambda o: o["profile"]),
    "profile.with_stack": Effect("run", ["profile.with_stack=true"], ["profile.steps=[2]"],
                                 view=lambda o: o["profile"].get("step_000002/rank0.trace.json")),
    "profile.memory": Effect("run", ["profile.memory=true"], ["profile.steps=[2]"],
                             view=lambda o: o["profile"].get("step_000002/rank0.trace.json")),
    # launch
    "launch.max_restarts": Effect("launcher", ["launch.max_restarts=3"]),
    "launch.monitor_interval": Effect("launcher", ["launch.monitor_interval=1.5"]),
    "launch.start_method": Effect("launcher", ["launch.start_method=spawn"]),
    "launch.threads_per_rank": Effect("run", ["launch.threads_per_rank=2"], view=probe("threads")),
    "launch.host_allocator": Effect("run", ["launch.host_allocator=system"], view=probe("host_allocator")),
    "launch.flush_denormals": Effect("run", ["launch.flush_denormals=false"], view=probe("flush_denormals")),
    # the run: tests/test_shm_collectives.py (and every multi-rank FSDP test, shm being the default)
    "launch.cpu_collectives": Effect("plan", ["launch.cpu_collectives=gloo"], ["parallel=fsdp2"]),
    "launch.cpu_gemm": Effect("run", ["launch.cpu_gemm=onednn"], ["launch.cpu_gemm=blas"],
                              view=in_log("run through oneDNN")),
    # parity: read by the report callback of +experiment=parity (tests/test_parity_report.py); refused without it
    "parity.enabled": refused("parity", ["parity.enabled=true"], "parity.enabled"),
    "parity.tolerance_mean": refused("parity", ["parity.tolerance_mean=0.1"], "parity.tolerance_mean"),
    "parity.tolerance_step": refused("parity", ["parity.tolerance_step=0.1"], "parity.tolerance_step"),
    "parity.baseline": refused("parity", ["parity.baseline=fsdp2"], "parity.baseline"),
    # the rest
    "trainer": refused("run", ["trainer._target_=hyperpar.nope.Trainer"], "hyperpar.nope"),
    "device": refused("run", ["device=tpu"], "tpu"),
    "dry_run": Effect("cli", ["dry_run=true"]),
    "run_dir": refused("cli", ["run_dir=/somewhere"], "run_dir"),
}


@pytest.fixture(scope="module")
def observer(tmp_path_factory) -> Observer:
    return Observer(tmp_path_factory.mktemp("keys"))


def test_every_schema_key_has_an_effect_and_a_doc_row() -> None:
    keys = set(schema_keys())
    assert not keys - set(EFFECTS), f"schema keys without an effect here: {sorted(keys - set(EFFECTS))}"
    assert not set(EFFECTS) - keys, f"entries for keys the schema no longer has: {sorted(set(EFFECTS) - keys)}"
    documented = doc_keys()
    assert len(documented) == len(set(documented)), "a key is listed twice in docs/guide/config.md"
    assert set(documented) == keys, {"undocumented": sorted(keys - set(documented)),
                                     "not in the schema": sorted(set(documented) - keys)}


@pytest.mark.parametrize("key", [k for k in schema_keys() if k in EFFECTS])
def test_changing_the_key_changes_behaviour_or_is_refused(key: str, observer: Observer) -> None:
    effect = EFFECTS[key]
    changed = observer.observe(effect.where, [*effect.base, *effect.change], effect.env)
    if effect.refused is not None:
        assert isinstance(changed, Refused), f"{key}: {effect.change} was accepted"
        assert effect.refused in changed.message, changed.message
        base = observer.observe(effect.where, effect.base, effect.env)
        assert not isinstance(base, Refused), f"{key}: the baseline is refused too: {base}"
        return
    base = observer.observe(effect.where, effect.base, effect.env)
    if key == "data.cache_dir":  # the same samples, cached where the key says
        assert not isinstance(changed, Refused), changed
        assert changed == base and any((observer.root / "other_cache").rglob("*")), "nothing cached in data.cache_dir"
        return
    if isinstance(changed, Refused) or isinstance(base, Refused):
        # Keys whose change turns a refusal into a run or back: a parallel degree the engine does not
        # support yet, a VL checkpoint in a text model group (model.text_only), a checkpoint with
        # tensors the model does not read (model.allow_unused_weights).
        assert effect.may_refuse, f"{key}: {changed if isinstance(changed, Refused) else base}"
        assert not (isinstance(changed, Refused) and isinstance(base, Refused)), f"{key}: both refused: {changed}"
        return
    assert effect.view(changed) != effect.view(base), f"{key}: {effect.change} changed nothing in {effect.where}"


def test_unknown_data_extra_key_is_refused_per_type(observer: Observer) -> None:
    for base, typo in ((["data=dummy"], "+data.extra.nosie=0.1"), (JSON, "+data.extra.add_eoss=false"),
                       (["data=vl_dummy", "model=qwen3_vl_moe"], "+data.extra.video_fractoin=0.5")):
        got = observer.observe("data", [*base, typo])
        assert isinstance(got, Refused) and "is not a key of data.type" in got.message, got
        assert typo.split("=")[0].split(".")[-1] in got.message


def test_experts_impl_without_experts_is_one_line(observer: Observer) -> None:
    got = observer.observe("plan", ["model=qwen3_5", "model.experts_impl=grouped"])
    assert isinstance(got, Refused) and "model=qwen3_5 has no routed experts" in got.message, got
    got = observer.observe("plan", ["model=qwen3_5_moe", "model.experts_impl=grouped_mm"])
    assert isinstance(got, Refused) and "model.experts_impl='grouped_mm'" in got.message, got
    assert "experts_impl=grouped" in observer.observe("plan", ["model=qwen3_vl_moe", "model.experts_impl=grouped"])


def test_mtp_on_a_family_without_mtp_is_one_line(observer: Observer) -> None:
    for model in ("qwen3_5", "qwen3_vl_moe"):
        got = observer.observe("plan", [f"model={model}", "model.mtp_loss_weight=0.3"])
        assert isinstance(got, Refused) and f"model={model} has no MTP module" in got.message, got


@pytest.mark.parametrize("name", ["gpipe", "1F1B", "Interleaved1F1B", "interleaved_1f1b", "ZERO_BUBBLE"])
def test_pipeline_schedule_names(name: str) -> None:
    from hyperpar.plan import PP_SCHEDULES, check_pp_schedule

    assert check_pp_schedule(name) in PP_SCHEDULES


def test_max_restarts_without_our_launcher_says_so_once(observer: Observer) -> None:
    obs = observer.observe("run", ["launch.max_restarts=2"])
    note = "launch.max_restarts=2 has no effect with one process"
    assert obs["stderr"].count(note) == 1, obs["stderr"]
    assert "max_restarts" not in observer.observe("run", [])["stderr"]


_STEP_PROBE = """
import json, torch
from hyperpar.device import resolve_device
dev = resolve_device("cpu")
dev.reset_peak_memory()
big = torch.ones(50_000_000)  # 200 MB of fresh pages (glibc maps a block this size anew), touched
with_big = [dev.peak_memory_mb(), dev.page_faults()]
del big
dev.reset_peak_memory()
small = torch.ones(10)
print(json.dumps([with_big, [dev.peak_memory_mb(), dev.page_faults()]]))
"""


@functools.lru_cache(maxsize=1)
def _step_probe() -> tuple[list, list]:
    """The per-step CPU figures (peak RSS MB, page faults) of a window that touches 200 MB of fresh
    memory and of the next window, which touches nothing new. Measured in a fresh process with glibc's
    own policy: this one's heap depends on the tests before it (an in-process run sets
    launch.host_allocator=retain, which keeps freed memory resident and lets a later 200 MB block reuse
    pages that are already counted)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _STEP_PROBE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    with_big, without = json.loads(res.stdout.splitlines()[-1])
    return with_big, without


def test_cpu_peak_memory_is_per_step() -> None:
    """The figure follows the step: a step that allocates 200 MB more reports it, the next one does not."""
    (with_big, _), (without, _) = _step_probe()
    if with_big is None:
        pytest.skip("this kernel cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    assert with_big - without > 150, (with_big, without)


def test_cpu_page_faults_are_per_step() -> None:
    """``page_faults`` counts the window since the last reset: 200 MB of fresh memory is at least one
    fault per 2 MB (huge pages) and usually one per 4 kB; a window that touches nothing new counts
    next to none."""
    (_, with_big), (_, without) = _step_probe()
    assert with_big >= 100, with_big
    assert without < with_big / 10, (with_big, without)


def test_mfu_is_null_without_a_known_peak() -> None:
    from hyperpar.device import resolve_device

    dev = resolve_device("cpu")
    assert dev.peak_flops(torch.float32) is None
    assert dev.peak_flops(torch.bfloat16, 2.0) == 2e12
