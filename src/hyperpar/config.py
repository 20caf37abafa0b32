"""Structured schemas for every config group, registered in Hydra's ConfigStore.

The schemas make Hydra reject a typo (``parallel.tpp=2``), a wrong type (``train.steps=abc``) or an
unknown group option at compose time. ``+key=value`` bypasses struct mode, so the driver re-merges
the composed config into :class:`JobConfig` (:func:`validate_schema`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from hyperpar.errors import ConfigError
from hyperpar.host_allocator import MODES as HOST_ALLOCATOR_MODES

START_METHODS = ("forkserver", "spawn")  # launch.start_method (worker_fork.py)
CPU_COLLECTIVES = ("shm", "gloo")  # launch.cpu_collectives (distributed/shm_collectives.py)
CPU_MATMUL = ("auto", "native", "fp32")  # train.mixed_precision.cpu_matmul (models/layers/cpu_matmul.py)
CPU_GEMM = ("auto", "blas", "onednn")  # launch.cpu_gemm (models/layers/onednn_gemm.py)


@dataclass
class MixedPrecisionConfig:
    param_dtype: str = "float32"  # float32 | bfloat16 | float16
    reduce_dtype: str = "float32"
    # 16-bit matmuls on CPU: auto (fp32 GEMMs on the 16-bit values where the CPU has no 16-bit GEMM,
    # e.g. x86 without AVX-512) | native (torch's own 16-bit GEMM) | fp32 (always on CPU)
    cpu_matmul: str = "auto"
    # One data-parallel CPU rank (no tp, pp or ep) under a 16-bit policy: cast the parameters for each
    # forward and backward without FSDP's unshard copies (same numbers; distributed/one_rank_cast.py)
    one_rank_cast: bool = True


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 1234
    global_batch_size: int = 8
    micro_batch_size: int = 2
    seq_len: int = 128
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    activation_checkpoint: str = "none"  # none | full | selective
    compile: bool = False  # torch.compile per decoder block (kernels eager); not with zero-bubble pp or selective AC
    loss_parallel: Optional[bool] = None  # vocab-sharded cross-entropy under tp; None: on when tp > 1
    # fp32 head (plain weight, no pp): its matmul runs inside the cross-entropy, in row chunks, so the
    # (tokens x vocab) logits and their gradient are never whole; 16-bit, tp and pp heads keep logits
    fused_head_loss: bool = True
    log_every: int = 1  # console / progress-bar line every N steps; metrics.jsonl still gets every step
    # torch.use_deterministic_algorithms (warn-only) + CUBLAS_WORKSPACE_CONFIG + no cuDNN autotuning:
    # a rerun repeats on GPU/NPU too, a little slower, except ops that only warn (CUDA attention backward:
    # see training.md "Determinism"); CPU kernels are deterministic anyway.
    deterministic: bool = True
    # Under ``deterministic`` PyTorch also NaN-fills every new tensor (a read of uninitialised memory then
    # shows): a second kernel per allocation, ~40 % more kernels in a GPU step. Every kernel we run writes
    # its whole output, so the fill is off unless asked for (hunting such a read).
    fill_uninitialized_memory: bool = False
    # End the loop after this many optimizer steps without changing the schedule (which still spans
    # ``steps``): a run that stops early and resumes later follows the uninterrupted trajectory.
    stop_after_steps: Optional[int] = None
    pp_microbatches: Optional[int] = None  # pipeline micro-batches per step; None: the gradient-accumulation count


@dataclass
class ParallelConfig:
    _target_: str = "hyperpar.distributed.parallel_dims.ParallelDims"
    name: str = "single"
    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of world_size
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1
    pp_schedule: str = "1F1B"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble (case-insensitive; used when pp > 1)
    pp_layers: Optional[list[int]] = None  # decoder layers per (virtual) stage; None: balanced, embedding/head counted
    # tensor parallel: norms/residuals sequence-sharded over tp; vision tower TP'd (else replicated);
    # KV (GatedDeltaNet key) heads tp does not divide: replicate their projections (each rank keeps those it reads)
    sequence_parallel: bool = True
    vision_tp: bool = False
    replicate_kv_heads: bool = True
    # false: FSDP units stay gathered from forward to backward (no second all-gather; every unit held)
    fsdp_reshard_after_forward: bool = True
    # true: the embedding and head sharded by vocabulary over the FSDP ranks, which exchange tokens
    # instead of gathering those weights (FSDP/HSDP and CP; distributed/dp_vocab.py)
    fsdp_vocab_parallel: bool = False


@dataclass
class ModelConfig:
    _target_: str = "hyperpar.models.build.ModelBuilder"
    name: str = "qwen3_5"
    flavor: str = "debug"
    hf_path: Optional[str] = None  # HF directory (config.json + safetensors): geometry and weights
    load_weights: bool = True  # with hf_path: load its weights (false: geometry only, fresh init)
    mtp_loss_weight: float = 0.0  # > 0: train the MTP head (Qwen3.5-MoE families only)
    default_data: Optional[str] = None  # the data.type that data=auto (the default) trains on; None: the family's
    # VL checkpoint into a text model group: only when asked; the vision tower is left out (one line).
    text_only: bool = False
    # Load a checkpoint holding tensors the model does not read (named in one line) instead of refusing it.
    allow_unused_weights: bool = False
    # Geometry on top of hf_path's config.json (or the flavour): a stack is cut to its first N entries.
    num_hidden_layers: Optional[int] = None  # short for overrides.num_hidden_layers
    overrides: dict = field(default_factory=dict)  # text fields; vision.* for the tower (e.g. vision.depth)
    # MoE experts' GEMMs: grouped (torch._grouped_mm) | loop (one GEMM per expert) | auto (per device
    # and GEMM policy); not a checkpoint field, and the results agree to the order of the sums
    experts_impl: str = "auto"


@dataclass
class DataConfig:
    _target_: str = "hyperpar.data.registry.build_dataset"
    type: str = "dummy"
    # Fields used by some types only: a field changed from its default that the type does not read is
    # rejected, and so is an extra key the type does not declare (hyperpar.data.registry).
    path: Optional[str] = None
    tokenizer: Optional[str] = None
    prefix: Optional[str] = None
    blend: Optional[Any] = None
    text_key: str = "text"
    pack: bool = True
    cache_dir: Optional[str] = None
    split: str = "train"  # hf/json: dataset split ("train", "train[:1000]"); megatron: train | valid | test
    shuffle: bool = True  # hf/json/preset: reshuffle the samples of every epoch with train.seed
    chat: Optional[bool] = None  # hf/json: chat template + assistant-only loss; None: when a messages column exists
    max_samples: Optional[int] = None  # hf/json: first N records; preset: first N rows
    format: Optional[str] = None  # hf: json | parquet | arrow | csv | text | disk; None: from the file names
    extra: dict = field(default_factory=dict)


@dataclass
class OptimConfig:
    _target_: str = "hyperpar.train.optim.build_optimizer"
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | constant | linear
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1


@dataclass
class CheckpointConfig:
    _target_: str = "hyperpar.checkpoint.manager.build_checkpointer"
    enabled: bool = False
    save_steps: int = 0
    keep_last: int = 2
    load_path: Optional[str] = None
    resume: str = "never"  # auto | never
    async_save: bool = False
    export_hf_at_end: bool = False


@dataclass
class MetricsConfig:
    tensorboard: bool = False
    progress_bar: bool = True
    # Peak dense FLOP/s per device in TFLOP/s for MFU; None: the device's known figure, else MFU is null.
    peak_tflops: Optional[float] = None
    # MoE: log each step's expert assignments per block (route_counts) next to route_hash and
    # route_margin; parity sweeps use them to tell a near-tied token's flip from a routing error.
    route_counts: bool = False


@dataclass
class ProfileConfig:
    # optimizer steps to profile with torch.profiler (1-based, as metrics.jsonl numbers them); []: off.
    # Skip the first steps: they compile (train.compile) and first-touch the optimizer state.
    steps: list[int] = field(default_factory=list)
    ranks: Optional[list[int]] = None  # ranks that profile; None: every rank
    record_shapes: bool = False  # operator input shapes (the table then splits ops by shape)
    with_stack: bool = False  # Python stacks in the trace (larger, slower)
    memory: bool = False  # allocations per operator
    trace: bool = True  # write the Chrome trace (rank<r>.trace.json); the tables are always written
    row_limit: int = 30  # operators in rank<r>.txt and rank<r>.json


@dataclass
class LaunchConfig:
    max_restarts: int = 0
    monitor_interval: float = 0.2
    threads_per_rank: int = 0  # 0: cores / local ranks
    # CPU malloc policy of the training processes: retain (reuse freed step buffers) | system
    host_allocator: str = "retain"
    # CPU: subnormal floats flushed to zero on the compute threads (much faster; see denormals.py)
    flush_denormals: bool = True
    # CPU, several ranks on one host: FSDP's all-gathers and reduce-scatters through /dev/shm (shm) or gloo
    cpu_collectives: str = "shm"
    # CPU, fp32 linears: torch's BLAS (MKL) or oneDNN's GEMM; auto = oneDNN on AMD CPUs with AVX-512
    cpu_gemm: str = "auto"
    # how the launcher starts local workers: forked from a server that imported torch once, or spawned
    start_method: str = "forkserver"


@dataclass
class ParityConfig:
    enabled: bool = False
    tolerance_mean: float = 5e-3
    # None: 1e-5 in fp32, skipped in bf16; a number > 0: every job; "off": not checked (Any: a str too)
    tolerance_step: Any = None
    baseline: Optional[str] = None


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    trainer: dict = field(default_factory=lambda: {"_target_": "hyperpar.train.trainer.Trainer"})
    device: str = "auto"  # auto | cpu | cuda | npu
    dry_run: bool = False
    run_dir: Optional[str] = None  # filled by the driver


_GROUP_SCHEMAS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
}


def register_configs() -> None:
    """Store schemas under schema/<group>/base so YAML files extend them without listing them as options."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="hyperpar_schema", node=JobConfig)
    for group, node in _GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name="base", node=node)


def compose_config(overrides: list[str]) -> DictConfig:
    """The job config Hydra composes from ``overrides`` (no ``hydra.*`` keys), outside ``@hydra.main``;
    Hydra's errors propagate."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="hyperpar.conf", version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


_DEGREES = ("world_size", "dp_replicate", "dp_shard", "tp", "cp", "ep", "pp", "vpp")


def name_layout(cfg: DictConfig) -> DictConfig:
    """``parallel.name`` as the run records it (result.json, checkpoints, parity reports): a packaged
    layout whose degrees the command line changed (``parallel=single parallel.world_size=4
    parallel.dp_shard=4``) is no longer that layout, so its name gets the changes appended
    (``single[world_size=4,dp_shard=4]``): the parity report would otherwise take a 4-rank job named
    'single' for a one-process baseline, and two jobs of one sweep would share a column. Names that
    are not a packaged layout are the user's and stay. Returns ``cfg``."""
    from importlib import resources

    name = str(cfg.parallel.name)
    if not name.replace("_", "").isalnum():  # not a file name of conf/parallel
        return cfg
    try:
        shipped = OmegaConf.create((resources.files("hyperpar.conf") / "parallel" / f"{name}.yaml").read_text())
    except OSError:
        return cfg
    base = OmegaConf.structured(ParallelConfig)
    packaged = {k: shipped.get(k, base[k]) for k in _DEGREES}
    given = {k: cfg.parallel[k] for k in _DEGREES}

    def shard(d: dict) -> int:  # dp_shard=-1: what is left of world_size
        rest = d["dp_replicate"] * d["tp"] * d["cp"] * d["pp"]
        return d["world_size"] // rest if d["dp_shard"] == -1 and rest else d["dp_shard"]

    changed = [f"{k}={given[k]}" for k in _DEGREES if given[k] != packaged[k]
               and not (k == "dp_shard" and shard(given) == shard(packaged))]
    if changed:
        cfg.parallel.name = f"{name}[{','.join(changed)}]"
    return cfg


def validate_schema(cfg: DictConfig) -> DictConfig:
    """Re-merge into the schema: catches keys force-added with ``+`` that struct mode let through."""
    container = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(container, dict):
        container.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), container)
    except Exception as e:  # omegaconf raises several types; all mean "this key/value is not in the schema"
        msg = str(e).splitlines()[0]
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{msg}" + (f" (key: {key})" if key else ""), hint="check the key name and type against `python -m hyperpar --cfg job`") from None
    return merged


# ---- values the schema's types cannot reject ----------------------------------------------------
# (key, test, what it must be). A key the schema lacks (a field renamed elsewhere) is skipped.
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf"))


_VALUE_RULES: list[tuple[str, Any, str]] = [
    ("train.steps", lambda v: v >= 1, ">= 1"),
    ("train.global_batch_size", lambda v: v >= 1, ">= 1 (samples per optimizer step)"),
    ("train.micro_batch_size", lambda v: v >= 1, ">= 1 (samples per forward pass per rank)"),
    ("train.seq_len", lambda v: v >= 1, ">= 1 (tokens per sample)"),
    ("train.seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    ("train.max_grad_norm", _finite, "a finite number (<= 0 disables clipping)"),
    ("train.log_every", lambda v: v >= 1, ">= 1"),
    ("train.stop_after_steps", lambda v: v is None or v >= 0, ">= 0 or null"),
    ("train.mixed_precision.param_dtype", lambda v: v in _DTYPES, "one of float32, bfloat16, float16"),
    ("train.mixed_precision.reduce_dtype", lambda v: v in _DTYPES, "one of float32, bfloat16, float16"),
    ("train.mixed_precision.cpu_matmul", lambda v: v in CPU_MATMUL, f"one of {', '.join(CPU_MATMUL)}"),
    ("train.activation_checkpoint", lambda v: v in ("none", "full", "selective"), "one of none, full, selective"),
    ("optim.lr", lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("optim.weight_decay", lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    ("optim.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.eps", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.schedule", lambda v: v in ("cosine", "constant", "linear"), "one of cosine, constant, linear"),
    ("checkpoint.save_steps", lambda v: v >= 0, ">= 0 (0: save only at the end)"),
    ("checkpoint.keep_last", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("checkpoint.resume", lambda v: v in ("auto", "never"), "one of auto, never"),
    ("data.max_samples", lambda v: v is None or v >= 1, ">= 1 or null"),
    ("model.mtp_loss_weight", lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    ("launch.max_restarts", lambda v: v >= 0, ">= 0"),
    ("launch.monitor_interval", lambda v: _finite(v) and v > 0, "a finite number > 0 (seconds)"),
    ("launch.threads_per_rank", lambda v: v >= 0, ">= 0 (0: cores / local ranks)"),
    ("launch.host_allocator", lambda v: v in HOST_ALLOCATOR_MODES, f"one of {', '.join(HOST_ALLOCATOR_MODES)}"),
    ("launch.cpu_collectives", lambda v: v in CPU_COLLECTIVES, f"one of {', '.join(CPU_COLLECTIVES)}"),
    ("launch.start_method", lambda v: v in START_METHODS, f"one of {', '.join(START_METHODS)}"),
    ("launch.cpu_gemm", lambda v: v in CPU_GEMM, f"one of {', '.join(CPU_GEMM)}"),
    ("profile.steps", lambda v: all(int(s) >= 1 for s in v), "a list of optimizer steps >= 1 (e.g. [4])"),
    ("profile.ranks", lambda v: v is None or all(int(r) >= 0 for r in v), "null (every rank) or a list of ranks >= 0"),
    ("profile.row_limit", lambda v: v >= 1, ">= 1"),
    ("metrics.peak_tflops", lambda v: v is None or (_finite(v) and v > 0), "> 0 or null"),
    ("parity.tolerance_mean", lambda v: _finite(v) and v > 0, "a finite number > 0"),
    ("parity.tolerance_step", lambda v: v is None or v is False or (isinstance(v, str) and v.lower() in ("auto", "off", "none"))
     or (not isinstance(v, (str, bool)) and _finite(v) and v > 0), "> 0, null (auto) or off"),
]
_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_MISSING = object()


def check_values(cfg: DictConfig, *, warn: bool = True) -> DictConfig:
    """Reject a value no run can use (``train.global_batch_size=0``, ``optim.lr=-1e-3``, ...) with one
    ConfigError naming the key, before anything is built or written. Returns ``cfg``.

    ``optim.lr=0`` is allowed (a forward-only check of a pipeline) with a warning on rank 0."""
    import os
    import sys

    for key, ok, what in _VALUE_RULES:
        value = OmegaConf.select(cfg, key, default=_MISSING)
        if value is _MISSING:
            continue
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ConfigError(f"{key}={value} must be {what}")
    speak = warn and int(os.environ.get("RANK", 0)) == 0  # warnings come from rank 0 only
    if speak and OmegaConf.select(cfg, "train.fill_uninitialized_memory", default=False) \
            and not OmegaConf.select(cfg, "train.deterministic", default=True):
        print("[hyperpar] warning: train.fill_uninitialized_memory=true does nothing with train.deterministic=false "
              "(PyTorch fills new tensors only in deterministic mode)", file=sys.stderr)
    _check_profile(cfg, speak)
    if speak and OmegaConf.select(cfg, "optim.lr", default=None) == 0:
        print("[hyperpar] warning: optim.lr=0: the weights will not change", file=sys.stderr)
    if speak and str(OmegaConf.select(cfg, "train.mixed_precision.param_dtype", default="")) in ("float16", "fp16"):
        print("[hyperpar] warning: param_dtype=float16 has no loss scaling here: small gradients underflow to "
              "zero; bfloat16 keeps fp32's range", file=sys.stderr)
    return cfg


def _check_profile(cfg: DictConfig, speak: bool) -> None:
    """A profiled rank the layout does not have is an error; a step the run never reaches, a warning."""
    import sys

    ranks = OmegaConf.select(cfg, "profile.ranks", default=None)
    world = OmegaConf.select(cfg, "parallel.world_size", default=None)
    if ranks is not None and isinstance(world, int):
        if missing := sorted({int(r) for r in ranks if int(r) >= world}):
            raise ConfigError(f"profile.ranks={list(ranks)}: the layout has ranks 0..{world - 1}, not {missing}",
                              hint="name ranks below parallel.world_size, or profile.ranks=null for every rank")
    steps = OmegaConf.select(cfg, "profile.steps", default=None) or []
    last = OmegaConf.select(cfg, "train.steps", default=None)
    if speak and isinstance(last, int) and (late := sorted({int(s) for s in steps if int(s) > last})):
        print(f"[hyperpar] warning: profile.steps {late} lie after train.steps={last}: not profiled", file=sys.stderr)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def dtype_of(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ConfigError(f"unknown dtype '{name}'", hint="use float32, bfloat16 or float16")
    return table[name]


__all__ = [
    "JobConfig", "TrainConfig", "ParallelConfig", "ModelConfig", "DataConfig", "OptimConfig",
    "CheckpointConfig", "MetricsConfig", "ProfileConfig", "LaunchConfig", "ParityConfig", "MixedPrecisionConfig",
    "register_configs", "validate_schema", "check_values", "dtype_of", "MISSING",
]


def build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets our own user errors through unwrapped (one line, no traceback)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from hyperpar.errors import HyperparError

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, HyperparError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise
