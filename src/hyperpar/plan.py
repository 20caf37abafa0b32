"""The driver's plan: validate the layout against the model and batch, estimate memory per rank.

Everything here runs before any worker starts, on the meta device, so an impossible plan costs a
fraction of a second instead of a cluster allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from hyperpar.config import dtype_of
from hyperpar.distributed.parallel_dims import ParallelDims
from hyperpar.errors import ConfigError, PlanError


@dataclass
class Plan:
    pdims: ParallelDims
    model_desc: str
    total_params: int
    largest_block_params: int
    params_per_rank: float
    mem_params_mb: float
    mem_grads_mb: float
    mem_optim_mb: float
    mem_gathered_mb: float
    grad_accum: int
    problems: list[str]
    tp_split_params: int = 0  # parameters the tensor-parallel plan splits over tp
    tp_setup: str = ""
    pp_setup: str = ""  # stages, layers per stage, schedule, micro-batches (pp > 1)
    row_padding: str = ""  # seq_len padded to the sequence split (cp, tp under SP)
    head_padding: str = ""  # query / value heads padded with empty ones to a multiple of cp
    compile: bool = False
    units_kept: bool = False  # FSDP units stay gathered from forward to backward (every unit counted)
    root_unit_params: float = 0.0  # per rank: embeddings, head, final norm (what no block holds)
    one_rank_cast: bool = False  # one CPU rank, 16-bit compute: every parameter's 16-bit copy held for the step
    one_rank_plain: bool = False  # one fp32 rank: no FSDP, nothing gathered
    collectives: str = ""  # CPU ranks: how FSDP's collectives travel (launch.cpu_collectives)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def _gathered_label(self) -> str:
        if self.one_rank_plain:
            return "gathered nothing (one fp32 rank: no FSDP)"
        if self.one_rank_cast:
            return "16-bit copies of all parameters (one-rank casts)"
        return "gathered units, kept to backward" if self.units_kept else "gathered blocks and root"

    def render(self) -> str:
        p = self.pdims
        axes = ", ".join(f"{a}={s}" for a, s in p.sizes().items())
        total_mem = self.mem_params_mb + self.mem_grads_mb + self.mem_optim_mb + self.mem_gathered_mb
        lines = [
            f"layout      {p.describe()}",
            f"mesh        {axes}  (ep={p.ep}, vpp={p.vpp}); flattened: dp={p.dp}, dp_shard_cp={p.fsdp_size}",
            f"model       {self.model_desc}: {self.total_params / 1e6:.3f} M parameters",
            f"per rank    {self.params_per_rank / 1e6:.3f} M parameters (sharded over dp_shard x cp = {p.fsdp_size}"
            + (f"; {self.tp_split_params / 1e6:.3f} M split over tp = {p.tp}, "
               f"{(self.total_params - self.tp_split_params) / 1e6:.3f} M whole on every tp rank)" if p.tp > 1 else ")"),
            *([f"tensor par  {self.tp_setup}"] if p.tp > 1 else []),
            *([f"vocabulary  embedding and head sharded by vocabulary over dp_shard x cp = {p.fsdp_size}, never gathered; "
               "the ranks exchange tokens (parallel.fsdp_vocab_parallel)"] if p.fsdp_vocab_parallel and p.fsdp_size > 1 else []),
            *([f"pipeline    {self.pp_setup}"] if self.pp_setup else []),
            *([f"rows        {self.row_padding}"] if self.row_padding else []),
            *([f"heads       {self.head_padding}"] if self.head_padding else []),
            *([f"collectives {self.collectives}"] if self.collectives else []),
            *(["compile     torch.compile per decoder block (attention core, delta rule, MoE block eager) and the loss's passes"]
              if self.compile else []),
            f"memory/rank params {self.mem_params_mb:.1f} MB + grads {self.mem_grads_mb:.1f} MB + optimizer {self.mem_optim_mb:.1f} MB"
            f" + {self._gathered_label} {self.mem_gathered_mb:.1f} MB"
            f" = {total_mem:.1f} MB (activations not included)",
            f"batch       grad accumulation {self.grad_accum} micro-batches per step",
        ]
        if self.ok:
            lines.append("verdict     OK: the plan is valid")
        else:
            lines.append("verdict     REJECTED: " + "; ".join(self.problems))
        return "\n".join(lines)


def _blocks(model: nn.Module):
    """Every block in an indexable container (text layers, vision blocks, MTP layers): the FSDP units
    besides the root."""
    for module in model.modules():
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            yield from module.values() if isinstance(module, nn.ModuleDict) else module


def _rank_share(name: str, p: nn.Parameter, tp_split: set[str], tp: int, ep: int = 1) -> float:
    """A parameter's element count on one rank: its tensor-parallel part where the tp plan splits it,
    and a routed expert tensor's 1 / ep under ep."""
    return p.numel() / (tp if name in tp_split else 1) / (ep if ".mlp.experts." in name else 1)


def _block_sizes(model: nn.Module, tp_split: set[str] = frozenset(), tp: int = 1, ep: int = 1):
    """Parameter counts per rank of every block; the largest one is all-gathered at a time (its
    tensor-parallel split parameters gathered to the tp rank's part only; under ep the routed
    experts, a unit of their own gathered with their block, to the rank's 1 / ep of them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for block in _blocks(model):
        yield sum(_rank_share(names.get(id(p), ""), p, tp_split, tp, ep) for p in block.parameters())


def _root_unit_size(model: nn.Module, tp_split: set[str], tp: int, pp: int, shared_embedding: bool,
                    vocab_sharded: bool = False) -> float:
    """Parameter count per rank of the root FSDP unit (what no block holds: embeddings, the vision
    tower's patch embedding and merger, final norm, head), its tensor-parallel split parameters at the
    tp rank's part. Under pp the first stage's root holds the embeddings and the vision tower's, the
    last the rest (and the embedding too where ``shared_embedding``): the larger of the two.
    ``vocab_sharded`` (parallel.fsdp_vocab_parallel): the embedding and head are never gathered."""
    in_blocks = {id(p) for block in _blocks(model) for p in block.parameters()}
    if vocab_sharded:
        in_blocks |= {id(p) for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n}
    first = last = 0.0
    for name, p in model.named_parameters():
        if id(p) in in_blocks:
            continue
        size = _rank_share(name, p, tp_split, tp)
        if "embed_tokens" in name or ".visual." in f".{name}":
            first += size
            last += size if pp > 1 and shared_embedding and "embed_tokens" in name else 0.0
        else:
            last += size
    return first + last if pp == 1 else max(first, last)


def check_data(data_cfg: DictConfig, default_type: str) -> None:
    """An unknown data.type, or a data field / extra key the type would ignore, fails in the driver."""
    from omegaconf import OmegaConf

    from hyperpar.data.registry import check_options, resolve_type

    options = OmegaConf.to_container(data_cfg, resolve=True)
    check_options(resolve_type(data_cfg.type, default_type), options)


# torch.distributed.pipelining schedules the pipeline will drive (ScheduleGPipe, Schedule1F1B,
# ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def _tp_split_names(meta: nn.Module, pdims: ParallelDims, spec, train_cfg) -> set[str]:
    """Parameters the family's tensor-parallel plan splits (read from the plan, no mesh needed)."""
    if spec.tp_plan is None:
        return set()
    from hyperpar.distributed.tensor_parallel import sharded_parameters

    return sharded_parameters(meta, spec.tp_plan(meta, pdims, train_cfg))


def _tp_setup(pdims: ParallelDims, train_cfg) -> str:
    from hyperpar.distributed.tensor_parallel import use_loss_parallel

    return (f"sequence_parallel={pdims.sequence_parallel}, loss_parallel={use_loss_parallel(pdims, train_cfg)}, "
            f"vision_tp={pdims.vision_tp}, replicate_kv_heads={pdims.replicate_kv_heads}")


def _row_padding(pdims: ParallelDims, seq_len: int) -> str:
    from hyperpar.data.pad import padded_length

    padded = padded_length(seq_len, pdims.seq_multiple)
    if padded == seq_len:
        return ""
    return (f"seq_len {seq_len} padded to {padded} (a multiple of the sequence split {pdims.seq_multiple}); "
            f"the {padded - seq_len} pad tokens per row have masked labels and are left out of router statistics")


def check_pp_schedule(name: str) -> str:
    """The canonical schedule name for ``parallel.pp_schedule`` (case and ``-``/``_`` ignored)."""
    key = name.lower().replace("-", "").replace("_", "")
    for canonical in PP_SCHEDULES:
        if canonical.replace("_", "") == key:
            return canonical
    raise ConfigError(f"parallel.pp_schedule='{name}' is not a pipeline schedule", hint=f"use one of {', '.join(PP_SCHEDULES)}")


def check_mtp(weight: float, model_name: str, args: object, seq_len: int = 2) -> None:
    """model.mtp_loss_weight > 0 needs a family with an MTP module (its args carry the weight) and
    rows of at least 2 tokens (MTP row t reads tokens t and t + 1)."""
    if weight > 0 and not hasattr(args, "mtp_loss_weight"):
        raise ConfigError(f"model.mtp_loss_weight={weight} but model={model_name} has no MTP module",
                          hint="the Qwen3.5-MoE families have one: qwen3_5_moe, qwen3_5_moe_vl; else set model.mtp_loss_weight=0")
    if weight > 0 and seq_len < 2:
        raise ConfigError(f"model.mtp_loss_weight={weight} needs train.seq_len >= 2, got {seq_len} "
                          "(multi-token prediction reads each token and the next)",
                          hint="raise train.seq_len or set model.mtp_loss_weight=0")


def _check_vocab_parallel(pdims: ParallelDims, train_cfg) -> None:
    if pdims.fsdp_vocab_parallel:
        from hyperpar.distributed.dp_vocab import check

        check(pdims, bool(train_cfg.fused_head_loss))


def make_plan(cfg: DictConfig, *, strict: bool = True) -> Plan:
    """Build the plan; with ``strict`` raise the first problem as a PlanError."""
    from hyperpar.config import build as instantiate

    pdims: ParallelDims = instantiate(cfg.parallel)
    check_pp_schedule(cfg.parallel.pp_schedule)
    builder = instantiate(cfg.model)
    check_mtp(float(cfg.model.mtp_loss_weight), cfg.model.name, builder.args, int(cfg.train.seq_len))
    check_data(cfg.data, builder.auto_data)
    t = cfg.train
    problems: list[str] = []
    from hyperpar.distributed.compile import check_compile
    from hyperpar.distributed.pipeline import PipelineJob

    pp_job: list[PipelineJob | None] = []
    geometry = builder.geometry()
    for check in (pdims.check_supported, lambda: check_compile(pdims, t),
                  lambda: pp_job.append(PipelineJob.check(cfg, pdims, cfg.model.name, builder.args)),
                  lambda: pdims.check_model(geometry, global_batch_size=t.global_batch_size,
                                            micro_batch_size=t.micro_batch_size),
                  lambda: _check_vocab_parallel(pdims, t)):
        try:
            check()
        except PlanError as e:
            if strict:
                raise
            problems.append(str(e))
    if t.steps < 1:
        problems.append(f"train.steps={t.steps} must be >= 1")
    from hyperpar.device import resolve_device

    try:  # an unknown device, or one this host does not have, would stop the run before its first step
        dev = resolve_device(cfg.device)
        device_type = dev.type
        # torchrun says how many ranks share this node; our own launcher starts the whole world here
        from hyperpar.launch import env_rank, under_torchrun

        dev.check_local_processes(env_rank()[3] if under_torchrun() else pdims.world_size)
    except ConfigError as e:
        if strict:
            raise
        problems.append(str(e) + (f" ({e.hint})" if e.hint else ""))
        device_type = None
    if strict and problems:
        raise PlanError(problems[0])

    meta = builder.build_meta()
    total = sum(p.numel() for p in meta.parameters())
    try:
        split_names = _tp_split_names(meta, pdims, builder.spec, t) if pdims.tp > 1 else set()
    except ValueError as e:  # heads the tp plan cannot split: a dry run reports it (check_model named why)
        if strict:
            raise PlanError(str(e), hint="change the degrees or the model/batch sizes") from None
        if not problems:  # else the degree checks above said it in their words
            problems.append(str(e))
        split_names = set()
    blocks = list(_block_sizes(meta, split_names, pdims.tp, pdims.ep))
    largest = max(blocks, default=0)
    kept = pdims.fsdp_units_kept  # then a stage's units are all gathered at once
    tp_split = sum(p.numel() for n, p in meta.named_parameters() if n in split_names)
    # TP splits what its plan shards and leaves the rest whole on every tp rank; FSDP shards all of it.
    per_rank = (tp_split / pdims.tp + (total - tp_split)) / (pdims.fsdp_size * pdims.pp)
    master = 4  # FSDP keeps sharded fp32 master weights, fp32 grads and fp32 AdamW moments
    param_dtype, reduce_dtype = dtype_of(t.mixed_precision.param_dtype), dtype_of(t.mixed_precision.reduce_dtype)
    compute = param_dtype.itemsize
    mb = 2**20
    # The largest FSDP unit: a block, or the root (embeddings, head, norms: what no block holds).
    from hyperpar.distributed.pipeline import shares_embedding

    shared = shares_embedding(builder.args)
    # The root stays gathered for the whole step (fsdp.apply_fsdp: reshard_after_forward=False).
    root = _root_unit_size(meta, split_names, pdims.tp, pdims.pp, shared,
                           vocab_sharded=pdims.fsdp_vocab_parallel and pdims.fsdp_size > 1)
    unit = max(largest, root)
    reduce = reduce_dtype.itemsize
    from hyperpar.distributed.one_rank_cast import planned

    casts = planned(pdims, param_dtype, reduce_dtype, bool(t.mixed_precision.one_rank_cast), device_type)
    # One fp32 rank stays plain (fsdp.one_rank_is_plain): nothing is gathered or cast.
    plain = pdims.dp == 1 and pdims.cp == 1 and pdims.tp == 1 and param_dtype == reduce_dtype == torch.float32
    gathered = 0 if plain else total if casts else (sum(blocks) / pdims.pp if kept else 2 * largest) + root
    from hyperpar.distributed.context_parallel import head_padding

    return Plan(
        pdims=pdims, model_desc=builder.describe(), total_params=total, largest_block_params=largest,
        params_per_rank=per_rank, root_unit_params=root, tp_split_params=tp_split, tp_setup=_tp_setup(pdims, t), mem_params_mb=per_rank * master / mb, mem_grads_mb=per_rank * master / mb,
        mem_optim_mb=2 * per_rank * master / mb, mem_gathered_mb=gathered * compute / mb, units_kept=kept,
        one_rank_cast=casts, one_rank_plain=plain,
        grad_accum=pdims.grad_accum_steps(t.global_batch_size, t.micro_batch_size), problems=problems,
        pp_setup=pp_job[0].describe() if pp_job and pp_job[0] else "",
        row_padding=_row_padding(pdims, t.seq_len), compile=bool(t.compile),
        head_padding=head_padding(geometry, pdims.tp, pdims.cp),
        collectives=_collectives(cfg, pdims, device_type, unit * compute / mb, unit * reduce / mb,
                                 per_rank * pdims.fsdp_size * compute / mb if param_dtype == torch.float32 else 0.0),
    )


def _collectives(cfg: DictConfig, pdims: ParallelDims, device_type: str | None, unit_mb: float,
                 unit_reduce_mb: float, homed_mb: float = 0.0) -> str:
    """CPU ranks sharding FSDP units: FSDP's all-gathers and reduce-scatters through /dev/shm or gloo.
    ``homed_mb``: the fp32 parameters of a shard group, which then live in one shared copy
    (``shm_params``) and are never all-gathered."""
    if pdims.fsdp_size == 1 or device_type != "cpu":
        return ""
    if cfg.launch.cpu_collectives == "gloo":
        return "gloo for every collective (launch.cpu_collectives=gloo)"
    # One file per shard group and kind: a header and three all-gather outputs of the largest unit (slots
    # of one shard each), and reduce-scatter slots of one whole unit each (FSDP's reduce-scatter input).
    from hyperpar.distributed.shm_collectives import GATHER_REGIONS, HEADER

    w = pdims.fsdp_size
    # slots are whole MiB
    scatter_mb = w * math.ceil(unit_reduce_mb)
    if homed_mb:
        return (f"FSDP units' fp32 parameters in one shared copy per shard group, never all-gathered, and "
                f"reduce-scatters through shared memory (/dev/shm, about {homed_mb + scatter_mb:.0f} MB, shared by "
                "the host's ranks); the rest on gloo (launch.cpu_collectives=shm)")
    shm_mb = HEADER / 2**20 + GATHER_REGIONS * w * math.ceil(unit_mb / w) + scatter_mb
    return (f"FSDP all-gathers and reduce-scatters through shared memory (/dev/shm, about {shm_mb:.0f} MB "
            "for the largest unit, shared by the host's ranks); the rest on gloo (launch.cpu_collectives=shm)")
