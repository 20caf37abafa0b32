"""ParallelDims: the one place that knows the mesh axis names and sizes.

Axis order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Flattened views that other code
asks for: ``dp`` (replicate x shard: what the data loader splits over), ``dp_shard_cp`` (what FSDP
shards over), ``dp_cp`` (what the loss token count is reduced over).

Expert parallelism borrows its ``ep`` axis from ``dp_shard x cp`` (as torchtitan does): the
flattened ``dp_shard_cp`` axis is split into (``efsdp``, ``ep``), ``ep`` innermost, so an EP group
is ``ep`` neighbouring data-parallel (or context-parallel) ranks of one tp coordinate. Expert
parameters are FSDP-sharded over (dp_replicate, efsdp); everything else over (dp_replicate,
dp_shard_cp). Both meshes come from the one root mesh, so FSDP can combine them with the ep (x tp)
mesh of the expert parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperpar.errors import PlanError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Degrees > 1 on these axes are validated but not built yet; the driver rejects them up front.
# (Pipeline compositions not built yet are refused by distributed/pipeline.py's PipelineJob.check.)
NOT_SUPPORTED_YET: tuple[str, ...] = ()


@dataclass
class ParallelDims:
    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1
    name: str = "custom"
    pp_schedule: str = "1F1B"
    pp_layers: Any = None  # decoder layers per (virtual) stage; None: balanced
    sequence_parallel: bool = True
    vision_tp: bool = False
    replicate_kv_heads: bool = True
    fsdp_reshard_after_forward: bool = True
    fsdp_vocab_parallel: bool = False
    _mesh: Any = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_arithmetic()

    # ---- plan checks (no process group needed) -------------------------------------------
    def _check_arithmetic(self) -> None:
        for axis in ("world_size", "dp_replicate", "tp", "cp", "ep", "pp", "vpp"):
            if getattr(self, axis) < 1:
                raise PlanError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        others = self.dp_replicate * self.tp * self.cp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise PlanError(
                    f"world_size {self.world_size} is not divisible by dp_replicate*tp*cp*pp = {others}",
                    hint="dp_shard=-1 takes what is left; make world_size a multiple of the other degrees",
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise PlanError(f"parallel.dp_shard={self.dp_shard} must be >= 1 or -1 (the rest)")
        product = others * self.dp_shard
        if product != self.world_size:
            raise PlanError(
                f"degrees do not multiply to world_size: pp {self.pp} x dp_replicate {self.dp_replicate} x "
                f"dp_shard {self.dp_shard} x cp {self.cp} x tp {self.tp} = {product}, world_size = {self.world_size}",
                hint="fix one degree, or set dp_shard=-1 to infer it",
            )
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise PlanError(
                f"ep {self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp} (experts are split over "
                f"data/context-parallel ranks, not tensor-parallel ones)",
                hint="raise dp_shard (or cp) to a multiple of ep, or lower ep",
            )
        if self.vpp > 1 and self.pp == 1:
            raise PlanError("parallel.vpp > 1 needs pp > 1")

    def unsupported(self) -> list[str]:
        return [f"{a}={getattr(self, a)}" for a in NOT_SUPPORTED_YET if getattr(self, a) > 1]

    def check_supported(self) -> None:
        bad = self.unsupported()
        if bad:
            raise PlanError(
                f"not supported yet: {', '.join(bad)} (layout '{self.name}')",
                hint="this build trains DDP/FSDP/HSDP with tensor (+sequence), context, expert and pipeline parallel",
            )

    def check_model(self, geometry: dict[str, int], *, global_batch_size: int, micro_batch_size: int) -> None:
        """Divisibility of the model and batch against the degrees; ``geometry`` values of 0 mean 'absent'."""
        problems: list[str] = []

        def need(value: int, by: int, what: str, axis: str) -> None:
            if value and by > 1 and value % by:
                problems.append(f"{what} {value} not divisible by {axis} {by}")

        tp = self.tp
        need(geometry.get("num_attention_heads", 0), tp, "attention heads", "tp")
        # KV and GatedDeltaNet key heads tp does not divide are replicated (each rank keeps those it reads)
        for key, what in (("num_key_value_heads", "key/value heads"), ("linear_num_key_heads", "linear-attention key heads")):
            n = geometry.get(key, 0)
            if n and tp > 1 and n % tp and not self.replicate_kv_heads:
                problems.append(f"{what} {n} not divisible by tp {tp} and parallel.replicate_kv_heads=false")
        need(geometry.get("linear_num_value_heads", 0), tp, "linear-attention value heads", "tp")
        if self.vision_tp:
            need(geometry.get("vision_num_heads", 0), tp, "vision heads", "tp (parallel.vision_tp)")
            need(geometry.get("vision_intermediate_size", 0), tp, "vision MLP intermediate size", "tp (parallel.vision_tp)")
        # No check of the vocabulary, the dense MLP, the shared expert or the routed experts: they split
        # a size tp does not divide as torch.chunk does (ceil(n / tp) a rank, the last ranks fewer), and
        # the rank-local load, the lookup, the sharded cross-entropy, checkpoints, tensor_parallel.mlp_plan
        # and the experts' grouped GEMMs (each rank on its own shard) go by each shard's own size.
        # A size so small that torch.chunk's split leaves a rank nothing (5 over tp 4: 2 + 2 + 1 + 0)
        # is refused: the kernels have no empty-shard path.
        for key, what in (("vocab_size", "vocabulary"), ("intermediate_size", "MLP intermediate size"),
                          ("shared_expert_intermediate_size", "shared-expert intermediate size"),
                          ("moe_intermediate_size", "expert intermediate size")):
            n = geometry.get(key, 0)
            per_rank = -(-n // tp)
            if n and tp > 1 and per_rank * (tp - 1) >= n:
                problems.append(f"{what} {n} leaves a rank of tp {tp} an empty shard (torch.chunk's split: "
                                f"{per_rank} a rank)")
        need(geometry.get("num_experts", 0), self.ep, "experts", "ep")
        if self.ep > 1 and not geometry.get("num_experts", 0):
            problems.append(f"parallel.ep={self.ep} but the model has no experts")
        layers = geometry.get("num_hidden_layers", 0)
        if self.pp > 1 and layers < self.pp * self.vpp:
            problems.append(f"{layers} layers cannot fill pp {self.pp} x vpp {self.vpp} stages")
        # No cp check of the heads: Ulysses repeats K/V (key) heads cp does not divide and pads query
        # (value) heads with empty ones (context_parallel.padded_heads; the plan prints the padding).
        # A seq_len that does not divide by seq_multiple is padded by the loader (hyperpar.data.pad).
        dp = self.dp
        if global_batch_size % (micro_batch_size * dp):
            problems.append(
                f"train.global_batch_size {global_batch_size} not divisible by micro_batch_size {micro_batch_size} "
                f"x data-parallel size {dp}"
            )
        if problems:
            raise PlanError("; ".join(problems), hint="change the degrees or the model/batch sizes")

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def seq_multiple(self) -> int:
        """What every row's length must divide by: cp shards, times tp under sequence parallelism.
        The loader right-pads rows to it with masked labels."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def fsdp_units_kept(self) -> bool:
        """FSDP units stay gathered from forward to backward: asked for, or the zero-bubble schedule,
        whose weight-gradient pass runs on the graph the forward recorded after the input pass."""
        from hyperpar.plan import check_pp_schedule

        zero_bubble = self.pp > 1 and check_pp_schedule(self.pp_schedule) == "zero_bubble"
        return not self.fsdp_reshard_after_forward or zero_bubble

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks an expert parameter is FSDP-sharded over (dp_shard x cp left after ep)."""
        return self.fsdp_size // self.ep

    def grad_accum_steps(self, global_batch_size: int, micro_batch_size: int) -> int:
        return global_batch_size // (micro_batch_size * self.dp)

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def describe(self) -> str:
        axes = " x ".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "1 rank"
        extra = f", ep={self.ep}" if self.ep > 1 else ""
        return f"{self.name}: world_size={self.world_size} ({axes}{extra})"

    # ---- mesh ----------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """Named DeviceMesh over all axes (size-1 axes included so every view always exists)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(getattr(self, a) for a in AXES), mesh_dim_names=AXES)
        # Keep the flattened views: torch wants callers to hold them rather than slice them from the root.
        self._flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        self._mesh = mesh
        if self.ep > 1:
            self._build_expert_mesh()
        return mesh

    def _build_expert_mesh(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # slicing a flattened dim: the view is what we want
            dense = self._mesh["dp_replicate", "dp_shard_cp"]
        experts = dense._unflatten(1, (self.efsdp, self.ep), ("efsdp", "ep"))
        self._flat["ep"] = experts["ep"]
        self._flat["expert_fsdp"] = experts["dp_replicate", "efsdp"]

    def submesh(self, name: str):
        """A named 1-D view: an axis of AXES or a flattened one (dp, dp_shard_cp, dp_cp; ep with EP)."""
        if name in AXES:
            return self.mesh[name]
        return self._flat[name] if self._mesh is not None else self.mesh

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def tp_mesh(self):
        """The 1-D tensor-parallel mesh (size 1 without TP)."""
        return self.mesh["tp"]

    def ep_mesh(self):
        """The 1-D expert-parallel mesh (only with ep > 1)."""
        return self._flat["ep"]

    def expert_fsdp_mesh(self):
        """2-D (dp_replicate, efsdp) mesh the expert parameters are FSDP-sharded over (ep > 1)."""
        return self._flat["expert_fsdp"]

    def fsdp_mesh(self):
        """2-D (replicate, shard) mesh: one FSDP code path covers single, DDP, FSDP and HSDP."""
        if self.cp == 1:
            return self.mesh["dp_replicate", "dp_shard"]
        import warnings

        with warnings.catch_warnings():
            # torch warns that slicing flattened dims will change; the view itself is what FSDP needs.
            warnings.simplefilter("ignore", UserWarning)
            return self.mesh["dp_replicate", "dp_shard_cp"]
