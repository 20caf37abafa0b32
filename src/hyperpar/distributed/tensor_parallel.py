"""Tensor (+ sequence) parallelism: the layer plans every family's ``parallelize.py`` composes.

Built on PyTorch's own engine (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` / ``PrepareModuleInput(Output)``, and ``loss_parallel`` in the objective). The
few styles PyTorch has no equivalent for are here, each a small ``ParallelStyle``:

- ``HeadShardedNorm``: a norm whose weight every head shares (q/k norms, the GatedDeltaNet output
  norm) applied to head-sharded activations. It runs on DTensors sharded over the head dim, so the
  weight gradient comes out Partial (each rank saw only its heads) and FSDP reduces it over tp.
- ``ReplicatedKV``: k/v projections whose KV heads tp does not divide (fewer than tp, or 3 over
  tp 2): every rank holds the full weight and keeps the KV heads its query heads read; gradients
  are Partial and summed. ``ReplicatedKeyHeads`` (with ``ReplicatedOutput``, ``ReplicateParams``)
  does the same for GatedDeltaNet's key heads.
- ``ExpertTensorParallel``: routed experts sharded on their intermediate dim; replicated tokens in,
  partial outputs all-reduced before the routing weights combine them (so the router, its aux loss
  and the shared-expert gate stay plain replicated computations with identical gradients).
- ``FullSequence``: a module that needs the whole sequence (DeepStack injection, the MTP head) gets
  plain full tensors under sequence parallelism and hands DTensors back.

Residual stream: sequence-sharded ``Shard(1)`` between blocks with ``sequence_parallel`` (norms run
on the shard), replicated without. Each mixer / FFN all-gathers its input once and reduce-scatters
(or all-reduces) its output once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["ParallelStyle", "Replicate", "Shard", "FullSequence", "ToSequenceShards", "apply_tensor_parallel",
           "lm_head_plan", "mtp_plan", "text_model_plan", "use_loss_parallel", "vision_tower_plan"]


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), p.requires_grad))


def shard_params(module: nn.Module, mesh: DeviceMesh, dims: dict[str, int]) -> None:
    """Turn ``module``'s own parameters ``name -> dim`` into DTensors sharded on ``dim`` (used by
    kernels through ``layers.local``)."""
    for name, dim in dims.items():
        p = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Shard(dim)]), p.requires_grad))


class ShardParams(ParallelStyle):
    """Shard the module's own parameters (``name -> dim``); inputs and outputs untouched."""

    def __init__(self, dims: dict[str, int]) -> None:
        super().__init__()
        self.dims = dict(dims)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_params(module, device_mesh, self.dims)
        return module


class HeadShardedNorm(ParallelStyle):
    """A norm applied per head to head-sharded local activations (B, S, heads_local, d), every input
    of the forward sharded the same way. The weight is replicated."""

    def __init__(self, head_dim: int = 2) -> None:
        super().__init__()
        self.head_dim = head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = self.head_dim

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                _replicate_params(mod, mesh)

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Shard(dim)], run_check=False) if isinstance(x, torch.Tensor) else x
                         for x in inputs)

        def output_fn(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


def heads_read(num_heads: int, num_read: int, tp: int, rank: int) -> list[int]:
    """The heads tp rank ``rank`` keeps of ``num_read`` shared ones (KV heads for attention's query
    heads, key heads for GatedDeltaNet's value heads), in the order its kernel reads them. Its
    ``num_heads`` reading heads are the ``rank``-th of tp equal runs; reading head h reads head
    h // (num_heads / num_read). When every kept head serves the same number of local reading heads
    the list holds each once (the kernel's own grouped repeat does the rest); otherwise one entry per
    local reading head (e.g. 6 heads, 3 KV heads, tp 2: rank 0 reads KV heads 0, 0, 1)."""
    local, group = num_heads // tp, num_heads // num_read
    read = [h // group for h in range(rank * local, (rank + 1) * local)]
    kept = sorted(set(read))
    if local % len(kept) == 0 and all(read.count(h) == local // len(kept) for h in kept):
        return kept
    return read


class ReplicatedOutput(ParallelStyle):
    """A linear with a replicated weight whose output every rank uses in part (GatedDeltaNet's q/k
    projections under ``ReplicatedKeyHeads``): the full output, its gradient Partial (each rank's
    share of the full gradient, summed over tp)."""

    def _keeper(self, mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
        """What this rank keeps of the full output (all of it here), fixed once per module."""
        return lambda full: full

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        keep = self._keeper(device_mesh)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                _replicate_params(mod, mesh)

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            elif x.placements != (Replicate(),):
                x = x.redistribute(mesh, [Replicate()])
            return (x, *inputs[1:])

        def output_fn(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return keep(out.to_local(grad_placements=[Partial()]))

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class ReplicatedKV(ReplicatedOutput):
    """k_proj / v_proj with KV heads tp does not divide (``parallel.replicate_kv_heads``): the weight
    is replicated, every rank computes all KV heads and keeps those its query heads read
    (``heads_read``). The kept slice's gradient is this rank's share of the full gradient
    (Partial), summed over tp."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def _keeper(self, mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
        tp, hd, nkv = mesh.size(), self.head_dim, self.num_kv_heads
        if self.num_heads % tp:
            raise ValueError(f"{self.num_heads} attention heads cannot be split over tp {tp}")
        heads = heads_read(self.num_heads, nkv, tp, mesh.get_local_rank())
        if heads == list(range(heads[0], heads[0] + len(heads))):
            return lambda full: full[..., heads[0] * hd : (heads[-1] + 1) * hd]
        index = torch.tensor(heads)
        return lambda full: full.unflatten(-1, (nkv, hd)).index_select(-2, index.to(full.device)).flatten(-2)


class ReplicateParams(ParallelStyle):
    """The module's own parameters replicated over tp (a kernel takes the part it needs; see
    ``ReplicatedKeyHeads`` for how their gradients are summed)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, device_mesh)
        return module


class ReplicatedKeyHeads(ParallelStyle):
    """GatedDeltaNet's recurrence when tp does not divide the key heads: q and k arrive with every key
    head (``ReplicatedOutput``) and the q/k conv weights whole (``ReplicateParams``); before the
    kernel each rank keeps the key heads its value heads read (``heads_read``), in q, k and the conv
    weights' head-major rows alike. Each rank's conv-weight gradient is its part of the full one, so
    it is summed over tp on the way back."""

    def __init__(self, num_value_heads: int, num_key_heads: int) -> None:
        super().__init__()
        self.num_value_heads = num_value_heads
        self.num_key_heads = num_key_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if self.num_value_heads % tp:
            raise ValueError(f"{self.num_value_heads} linear-attention value heads cannot be split over tp {tp}")
        heads = heads_read(self.num_value_heads, self.num_key_heads, tp, device_mesh.get_local_rank())
        index = torch.tensor(heads)
        nk = self.num_key_heads

        def keep(t: torch.Tensor, dim: int) -> torch.Tensor:
            return t.index_select(dim, index.to(t.device))

        def before(mod: nn.Module, args: tuple) -> tuple:
            q, k, v, g, beta, conv_q, conv_k, conv_v = args[:8]
            convs = (keep(_grad_all_reduce(w, device_mesh).view(nk, -1, w.shape[-1]), 0).flatten(0, 1)
                     for w in (conv_q, conv_k))
            return (keep(q, 2), keep(k, 2), v, g, beta, *convs, conv_v, *args[8:])

        module.register_forward_pre_hook(before)
        return module


def _grad_all_reduce(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the backward sums the (partial) gradient over the mesh."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _all_reduce(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of every rank's partial ``x``; the backward hands each rank the full gradient."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class ExpertTensorParallel(ParallelStyle):
    """``GroupedExperts`` (gate_proj, up_proj (E, Ie, H); down_proj (E, H, Ie)) sharded on Ie.

    forward(x_sorted, counts): the tokens are replicated on every tp rank; each rank runs its slice
    of every expert's intermediate dim, and the partial outputs (T·k, H) are all-reduced. Costs one
    all-reduce of the dispatched rows (k times the tokens) per MoE layer and direction."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                shard_params(mod, mesh, {"gate_proj": 1, "up_proj": 1, "down_proj": 2})

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (_grad_all_reduce(inputs[0], mesh), *inputs[1:])

        def output_fn(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return _all_reduce(out, mesh)

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class FullSequence(ParallelStyle):
    """The module sees plain full tensors: DTensor inputs (sequence-sharded or replicated) are
    gathered. Its tensor output is handed back as given by ``out_layout``: None (plain),
    ``Replicate()`` or ``Shard(1)`` (a DTensor). Parameters are left alone (hooks only)."""

    def __init__(self, out_layout: Any = None) -> None:
        super().__init__()
        self.out_layout = out_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(mod: nn.Module, inputs: tuple) -> tuple:
            return tuple(x.redistribute(device_mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x
                         for x in inputs)

        def post(mod: nn.Module, inputs: tuple, out: Any) -> Any:
            if self.out_layout is None or not isinstance(out, torch.Tensor):
                return out
            full = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return full if self.out_layout == Replicate() else full.redistribute(device_mesh, [self.out_layout])

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


class ToSequenceShards(ParallelStyle):
    """The module's first input (full, replicated, plain) becomes sequence-sharded ``Shard(1)``:
    where a VL model hands merged text+vision embeddings to its text decoder. Hooks only."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(mod: nn.Module, inputs: tuple) -> tuple:
            x = inputs[0]
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).redistribute(device_mesh, [Shard(1)])
            return (x, *inputs[1:])

        module.register_forward_pre_hook(pre)
        return module


# --- plans for the shared layers ------------------------------------------------------------------


def _stream(sp: bool):
    """Layout of the residual stream between blocks."""
    return Shard(1) if sp else Replicate()


def block_input(sp: bool, n_extra: int = 0) -> PrepareModuleInput:
    """A mixer / FFN gathers its (B, S, H) input once into a replicated DTensor; other positional
    inputs (rotary cos/sin, token masks) pass untouched."""
    return PrepareModuleInput(
        input_layouts=(_stream(sp), *([None] * n_extra)),
        desired_input_layouts=(Replicate(), *([None] * n_extra)),
        use_local_output=False,
    )


def attention_plan(prefix: str, *, num_heads: int, num_kv_heads: int, head_dim: int, tp: int, sp: bool,
                   replicate_kv: bool = True) -> dict[str, ParallelStyle]:
    """Gated / plain attention (``Attention``): heads split; q_proj's per-head [query; gate] rows stay
    together under a plain row split. KV heads split too, or (tp does not divide them) replicated
    (``ReplicatedKV``)."""
    local = {"use_local_output": True}
    plan: dict[str, ParallelStyle] = {
        prefix: block_input(sp, n_extra=2),
        f"{prefix}.q_proj": ColwiseParallel(**local),
        f"{prefix}.q_norm": HeadShardedNorm(),
        f"{prefix}.k_norm": HeadShardedNorm(),
        f"{prefix}.o_proj": RowwiseParallel(output_layouts=_stream(sp), use_local_output=not sp),
    }
    if num_kv_heads % tp == 0:
        plan[f"{prefix}.k_proj"] = ColwiseParallel(**local)
        plan[f"{prefix}.v_proj"] = ColwiseParallel(**local)
    elif replicate_kv:
        plan[f"{prefix}.k_proj"] = ReplicatedKV(num_heads, num_kv_heads, head_dim)
        plan[f"{prefix}.v_proj"] = ReplicatedKV(num_heads, num_kv_heads, head_dim)
    else:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp {tp} (parallel.replicate_kv_heads=false)")
    return plan


def gated_deltanet_plan(prefix: str, *, sp: bool, num_key_heads: int = 0, num_value_heads: int = 0, tp: int = 1,
                        replicate_kv: bool = True) -> dict[str, ParallelStyle]:
    """GatedDeltaNet: value heads (and the key heads they read) split; every per-head parameter
    follows its heads; the shared output-norm weight is replicated. Key heads tp does not divide
    (3 key heads, 6 value heads over tp 2) are replicated as attention's KV heads are
    (``ReplicatedKeyHeads``)."""
    local = {"use_local_output": True}
    plan: dict[str, ParallelStyle] = {prefix: block_input(sp)}
    split_keys = not num_key_heads or num_key_heads % tp == 0
    if not split_keys and not replicate_kv:
        raise ValueError(f"{num_key_heads} linear-attention key heads cannot be split over tp {tp} "
                         "(parallel.replicate_kv_heads=false)")
    for proj in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"):
        plan[f"{prefix}.{proj}"] = ColwiseParallel(**local)
    for conv in ("conv1d_q", "conv1d_k", "conv1d_v"):
        plan[f"{prefix}.{conv}"] = ShardParams({"weight": 0})
    if not split_keys:  # the key heads' projections and convs whole, the recurrence keeping its heads
        for part in ("q", "k"):
            plan[f"{prefix}.in_proj_{part}"] = ReplicatedOutput()
            plan[f"{prefix}.conv1d_{part}"] = ReplicateParams()
        plan[f"{prefix}.recurrence"] = ReplicatedKeyHeads(num_value_heads, num_key_heads)
    plan[prefix + "#params"] = ShardParams({"A_log": 0, "dt_bias": 0})
    plan[f"{prefix}.norm"] = HeadShardedNorm()
    plan[f"{prefix}.out_proj"] = RowwiseParallel(output_layouts=_stream(sp), use_local_output=not sp)
    return plan


def mlp_plan(prefix: str, *, sp: bool, gather_input: bool = True, uneven: bool = False) -> dict[str, ParallelStyle]:
    """SwiGLU MLP: gate/up column-split, down row-split back to the residual stream's layout.

    ``uneven``: the intermediate size does not divide by tp (torch.chunk's split, the first ranks a
    column more). gate/up then hand on DTensors, so down_proj sees the true global width; a plain
    local tensor would be re-wrapped as tp equal pieces."""
    local = {"use_local_output": not uneven}
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.gate_proj": ColwiseParallel(**local),
        f"{prefix}.up_proj": ColwiseParallel(**local),
        f"{prefix}.down_proj": RowwiseParallel(output_layouts=_stream(sp), use_local_output=not sp),
    }
    if gather_input:
        plan[prefix] = block_input(sp)
    return plan


def _uneven(mlp: nn.Module, tp: int) -> bool:
    """A SwiGLU MLP whose intermediate width tp does not divide (``mlp_plan``'s ``uneven``)."""
    return mlp.gate_proj.out_features % tp != 0


def moe_plan(prefix: str, *, sp: bool, shared_expert: nn.Module | None, tp: int) -> dict[str, ParallelStyle]:
    """SparseMoeBlock: a plain replicated region (router, combine, shared-expert gate) around
    tensor-parallel experts and a tensor-parallel shared expert."""
    plan: dict[str, ParallelStyle] = {f"{prefix}.experts": ExpertTensorParallel()}
    if sp:
        plan[prefix] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                          use_local_output=True)
        plan[prefix + "#out"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                    use_local_output=False)
    if shared_expert is not None:
        shared = f"{prefix}.shared_expert"
        plan[shared] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                          use_local_output=False)
        plan.update(mlp_plan(shared, sp=False, gather_input=False, uneven=_uneven(shared_expert, tp)))
    return plan


def norm_plan(names: Sequence[str], *, sp: bool) -> dict[str, ParallelStyle]:
    """Residual-stream norms run on the sequence shard under SP (and are left alone without)."""
    return {n: SequenceParallel() for n in names} if sp else {}


def decoder_layer_plan(prefix: str, layer: nn.Module, *, tp: int, sp: bool, replicate_kv: bool = True) -> dict[str, ParallelStyle]:
    """The plan of one decoder layer, from the types of its children (any family's block)."""
    from hyperpar.models.layers import Attention, GatedDeltaNet, RMSNorm, SparseMoeBlock, SwiGLUMLP

    plan: dict[str, ParallelStyle] = {}
    for name, child in layer.named_children():
        path = f"{prefix}.{name}"
        if isinstance(child, Attention):
            plan.update(attention_plan(path, num_heads=child.num_heads, num_kv_heads=child.num_kv_heads,
                                       head_dim=child.head_dim, tp=tp, sp=sp, replicate_kv=replicate_kv))
        elif isinstance(child, GatedDeltaNet):
            plan.update(gated_deltanet_plan(path, sp=sp, num_key_heads=child.num_key_heads,
                                            num_value_heads=child.num_value_heads, tp=tp, replicate_kv=replicate_kv))
        elif isinstance(child, SparseMoeBlock):
            plan.update(moe_plan(path, sp=sp, shared_expert=child.shared_expert, tp=tp))
        elif isinstance(child, SwiGLUMLP):
            plan.update(mlp_plan(path, sp=sp, uneven=_uneven(child, tp)))
        elif isinstance(child, RMSNorm):
            plan.update(norm_plan([path], sp=sp))
        elif any(True for _ in child.parameters()):
            raise ValueError(f"no tensor-parallel rule for {path} ({type(child).__name__})")
    return plan


def text_model_plan(prefix: str, text_model: nn.Module, *, tp: int, sp: bool, replicate_kv: bool = True,
                    embed_to_stream: bool = True) -> dict[str, ParallelStyle]:
    """Embedding (vocab-parallel), every decoder layer, final norm of a text stack at ``prefix``.

    ``embed_to_stream``: the embedding's output enters the residual stream directly (text models:
    sequence-sharded under SP); else it comes back full and plain (a VL model merges vision
    features into it first and hands the stack its input through ``ToSequenceShards``)."""
    p = f"{prefix}." if prefix else ""
    plan: dict[str, ParallelStyle] = {}
    if getattr(text_model, "embed_tokens", None) is not None:
        out = _stream(sp) if embed_to_stream else Replicate()
        plan[f"{p}embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=out,
                                                   use_local_output=out == Replicate())
    for name, layer in text_model.layers.items():
        plan.update(decoder_layer_plan(f"{p}layers.{name}", layer, tp=tp, sp=sp, replicate_kv=replicate_kv))
    if getattr(text_model, "norm", None) is not None:
        plan.update(norm_plan([f"{p}norm"], sp=sp))
    return plan


def lm_head_plan(path: str, *, sp: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Column-split head: vocab-sharded logits for the sharded cross-entropy, or gathered."""
    out = Shard(-1) if loss_parallel else Replicate()
    return {path: ColwiseParallel(input_layouts=_stream(sp), output_layouts=out, use_local_output=not loss_parallel)}


def mtp_plan(path: str, mtp: nn.Module, *, tp: int, sp: bool, replicate_kv: bool = True) -> dict[str, ParallelStyle]:
    """The MTP head runs on whole sequences (its one-token shift crosses shard edges): inputs gathered,
    its decoder layer tensor-parallel without SP, its output handed to the shared lm_head."""
    plan: dict[str, ParallelStyle] = {path: FullSequence(out_layout=Replicate() if sp else None)}
    for name, layer in mtp.layers.items():
        plan.update(decoder_layer_plan(f"{path}.layers.{name}", layer, tp=tp, sp=False, replicate_kv=replicate_kv))
    return plan


def vision_tower_plan(prefix: str, visual: nn.Module) -> dict[str, ParallelStyle]:
    """``parallel.vision_tp``: each vision block's attention heads and MLP split (the block input
    and output replicated: the tower has no sequence parallelism); patch embedding, positions and
    mergers replicated, so DeepStack and the merger hand full features to the text model."""
    plan: dict[str, ParallelStyle] = {}
    for name, block in visual.blocks.items():
        b = f"{prefix}.blocks.{name}"
        plan[f"{b}.attn"] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                               desired_input_layouts=(Replicate(), None, None), use_local_output=False)
        for proj in ("q", "k", "v"):
            plan[f"{b}.attn.{proj}"] = ColwiseParallel()
        plan[f"{b}.attn.proj"] = RowwiseParallel()
        plan[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                              use_local_output=False)
        plan[f"{b}.mlp.linear_fc1"] = ColwiseParallel()
        plan[f"{b}.mlp.linear_fc2"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, parallel_dims, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Apply ``plan`` on the tp mesh, then restore weight ties (each style registers its own
    DTensor parameters; a tied head and embedding share one vocab-sharded tensor again)."""
    apply_plan(model, parallel_dims.tp_mesh(), plan)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    return model


def sharded_parameters(model: nn.Module, plan: dict[str, ParallelStyle]) -> set[str]:
    """Names of the parameters ``plan`` splits over tp (the rest stay whole on every tp rank), read
    from the plan itself without a mesh: the planner's per-rank memory follows the real cut."""
    out: set[str] = set()
    for key, style in plan.items():
        path = key.split("#", 1)[0]
        module = model.get_submodule(path) if path else model
        prefix = f"{path}." if path else ""
        if isinstance(style, ColwiseParallel):  # weight rows and bias split
            names = ["weight", "bias"]
        elif isinstance(style, RowwiseParallel):  # weight columns split, bias whole
            names = ["weight"]
        elif isinstance(style, ShardParams):
            names = list(style.dims)
        elif isinstance(style, ExpertTensorParallel):
            names = ["gate_proj", "up_proj", "down_proj"]
        else:
            continue
        out.update(prefix + n for n in names if getattr(module, n, None) is not None)
    return out


def use_loss_parallel(parallel_dims, train_cfg) -> bool:
    """``train.loss_parallel``: None means on whenever tp > 1."""
    setting = getattr(train_cfg, "loss_parallel", None)
    return parallel_dims.tp > 1 and setting is not False


def apply_plan(root: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """``parallelize_module`` per entry; ``"path#tag"`` keys apply a second style to ``path``
    (e.g. an output preparation after an input preparation, or parameters of the module itself)."""
    for key, style in plan.items():
        path = key.split("#", 1)[0]
        module = root.get_submodule(path) if path else root
        parallelize_module_checked(module, mesh, style, key)


def parallelize_module_checked(module: nn.Module, mesh: DeviceMesh, style: ParallelStyle, key: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        parallelize_module(module, mesh, style)
    except Exception as e:  # a plan bug: name the entry that failed
        raise RuntimeError(f"tensor-parallel plan entry '{key}' ({type(style).__name__}) failed: {e}") from e
