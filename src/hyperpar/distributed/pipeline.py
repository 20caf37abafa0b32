"""Pipeline parallelism: cut a meta model into stages, run them with torch.distributed.pipelining.

A stage is the whole model with what it does not run deleted (the layer stack is an
``nn.ModuleDict`` keyed "0".."L-1", so the kept layers keep their names and with them their
initialisation, checkpoint and export keys). The first stage keeps the embedding, the last the
final norm, the head and the MTP module; with tied embeddings the last stage keeps the embedding
too, as the owner of the head's weight, and so it does for a trained MTP module (which embeds the
tokens): both copies start equal; their gradients are summed over the two stages after the
backward (``SharedEmbedding``).

Stage I/O: the first stage reads token ids, later stages the previous stage's hidden states. A
MoE stage also passes on its router statistics, packed in one fp32 vector and added stage by
stage, so the last stage forms the load-balancing loss from every layer's statistics of the
micro-batch, as one process does; its gradient flows back through the pipeline like the hidden
states'. Position ids and the attention mask reach every stage as keyword arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hyperpar.errors import PlanError
from hyperpar.models.layers.moe import RouterStats, active_route_record, record_router_stats, record_routes

log = logging.getLogger("hyperpar")

# Families whose stage forward (``StageForward``) is written; the others are refused in the plan.
PP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_vl_moe")
# What ``PipelineJob.check`` refuses today, as the support matrix page lists it.
NOT_BUILT: tuple[tuple[str, str], ...] = ()


# ---- split points ------------------------------------------------------------------------------


def stage_layer_counts(num_layers: int, num_stages: int, pp_layers: list[int] | None = None) -> list[int]:
    """Decoder layers per stage: ``pp_layers`` when given, else balanced by layer count with the
    embedding counted as one layer of the first stage and the head as one of the last."""
    if pp_layers:
        counts = [int(n) for n in pp_layers]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise PlanError(f"parallel.pp_layers={counts} must give {num_stages} stages >= 1 layer each, "
                            f"summing to the model's {num_layers} layers")
        return counts
    if num_layers < num_stages:
        raise PlanError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    units = num_layers + 2
    sizes = [units // num_stages + (1 if s < units % num_stages else 0) for s in range(num_stages)]
    counts = [size - (s == 0) - (s == num_stages - 1) for s, size in enumerate(sizes)]
    # A stage left with no layer (few layers, many stages) takes one from the largest.
    for s, n in enumerate(counts):
        if n < 1:
            counts[max(range(num_stages), key=lambda i: counts[i])] -= 1 - n
            counts[s] = 1
    return counts


def stage_ranges(num_layers: int, num_stages: int, pp_layers: list[int] | None = None) -> list[range]:
    ranges, start = [], 0
    for n in stage_layer_counts(num_layers, num_stages, pp_layers):
        ranges.append(range(start, start + n))
        start += n
    return ranges


def local_stage_ids(pp_rank: int, pp: int, vpp: int) -> list[int]:
    """The (virtual) stages one pp rank runs: looped placement, rank r holds r, r + pp, ..."""
    return [pp_rank + k * pp for k in range(vpp)]


# ---- router statistics on the wire ------------------------------------------------------------------


def pack_stats(stats: RouterStats | None, num_experts: int, device: torch.device) -> torch.Tensor:
    """(2E + 1,) fp32: counts, probability sums, tokens (zeros when no MoE layer ran)."""
    if stats is None:
        return torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)
    return torch.cat([stats.counts.float(), stats.prob_sum.float(), stats.tokens.float().reshape(1)])


def unpack_stats(packed: torch.Tensor, num_experts: int) -> RouterStats:
    E = num_experts
    return RouterStats(packed[:E].detach(), packed[E : 2 * E], packed[2 * E].detach())


# ---- the stage module ---------------------------------------------------------------------------------


def text_stack(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model``) or of a VL model (``model.model.language_model``)."""
    return getattr(model.model, "language_model", model.model)


def text_args(args):
    return getattr(args, "text", args)


class StageForward:
    """Mixed into a pruned model's class (``as_stage``): the forward a pipeline stage runs.

    ``x``: token ids (first stage) or hidden states; ``carried``: what travels with them, the packed
    router statistics of the stages before (MoE; not into the first stage) and then the tensors
    ``pp_carry_in`` names (VL: DeepStack levels, merged embeddings). Returns hidden states (and
    statistics, and ``pp_carry_out``'s tensors) to send on, or on the last stage the logits (and the
    micro-batch's statistics of every stage, and MTP logits)."""

    pp_num_experts: int = 0  # > 0: a MoE model, statistics travel with the hidden states
    pp_is_first: bool = False
    pp_is_last: bool = False
    pp_stream_mesh = None  # the tp mesh under sequence parallelism: hidden states travel as Shard(1) pieces
    pp_vl: bool = False
    pp_carry_in: tuple[str, ...] = ()
    pp_carry_out: tuple[str, ...] = ()
    pp_vision = None  # first VL stage: the step's StepVision, set before each schedule step
    pp_idle_tower_rows: frozenset[int] = frozenset()  # first rows of the micro-batches that run the tower on no images

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, **kwargs: Any):
        """``token_ids``: the micro-batch's tokens, read by the last stage's MTP module only (text
        models); ``row_index``: the micro-batch's rows of the step (the first VL stage picks their
        images); ``visual_mask``: where DeepStack adds its features (VL stages after the first).

        MoE routes (train/routes.py) are kept per call in ``pp_route_log``: the schedule's first step
        also runs each stage once on placeholder inputs to learn the shapes, which must not count;
        ``PipelineStep`` keeps the last calls, one per micro-batch."""
        if not self.pp_num_experts or active_route_record() is None:
            return self._stage_forward(x, *carried, **kwargs)
        with record_routes() as routes:
            out = self._stage_forward(x, *carried, **kwargs)
        self.__dict__.setdefault("pp_route_log", []).append(routes)
        return out

    def _stage_forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                       row_index: torch.Tensor | None = None, visual_mask: torch.Tensor | None = None):
        E = self.pp_num_experts
        carried = list(carried)
        stats = carried.pop(0) if E and not self.pp_is_first else None
        stats = self.__dict__.pop("_pp_stats_fp32", stats)  # see keep_stats_fp32
        received = dict(zip(self.pp_carry_in, carried))
        if self.pp_stream_mesh is not None and x.is_floating_point() and not isinstance(x, DTensor):
            # received hidden states are this rank's sequence shard of the SP residual stream
            x = DTensor.from_local(x, self.pp_stream_mesh, [Shard(1)], run_check=False)
        if self.pp_vl:
            return self._vl_forward(x, stats, received, position_ids, attention_mask, row_index, visual_mask)
        if self.pp_is_last:
            if getattr(self, "mtp_active", False):
                out = self._forward_with_mtp(x, position_ids, attention_mask, token_ids)
            else:
                out = super().forward(x, position_ids, attention_mask)
            return self._last_outputs(out, stats)
        with record_router_stats() as sink:
            h = self.model(x, position_ids, attention_mask)  # the text stack: what forward runs without a head
        return self._send(h, sink, stats, {})

    def _last_outputs(self, out, stats):
        from hyperpar.models.output import ModelOutput

        E = self.pp_num_experts
        if not E:
            return out.logits if isinstance(out, ModelOutput) and out.mtp_logits is None else out
        own = pack_stats(out.router_stats, E, out.logits.device)
        total = own if stats is None else stats + own
        return (out.logits, total) if out.mtp_logits is None else (out.logits, total, out.mtp_logits)

    def _send(self, h, sink, stats, carry: dict[str, torch.Tensor]):
        """What a stage before the last sends on: plain tensors (the local shard of the stream)."""
        if isinstance(h, DTensor):
            h = h.to_local()
        out = [h]
        E = self.pp_num_experts
        if E:
            own = pack_stats(RouterStats.pool(sink) if sink else None, E, h.device)
            out.append(own if stats is None else stats + own)
        out += [carry[name] for name in self.pp_carry_out]
        # Views leave as copies (to_local's stream shard, tensors passed on): FSDP's root warns on
        # every view in a stage's output, since an in-place op on one would skip its all-gather.
        out = [t.clone() if t._is_view() else t for t in out]
        return out[0] if len(out) == 1 else tuple(out)

    def _forward_with_mtp(self, h, position_ids, attention_mask, token_ids):
        """The head and the MTP step of the last stage: the MTP module reads the embedding of the
        tokens (this stage's copy of the embedding) and the stack's final hidden states."""
        from hyperpar.models.output import ModelOutput

        with record_router_stats() as sink:
            h = self.model(h, position_ids, attention_mask)
            mtp_h = self.mtp.predict(self.model.embed_tokens(token_ids), h, self.model.rotary_emb, position_ids,
                                     attention_mask)
            logits, mtp_logits = self.lm_head(h), self.lm_head(mtp_h)
        return ModelOutput.of(logits, sink, self.args.router_aux_loss_coef, mtp_logits)

    def _vl_forward(self, x, stats, received, position_ids, attention_mask, row_index, visual_mask):
        """A VL stage: the first embeds its rows' tokens and images (vision tower, placeholder scatter,
        DeepStack features); every stage runs its decoder layers, adding the DeepStack levels they
        own; the last one the head (and the MTP step on the carried merged embeddings)."""
        from hyperpar.models.multimodal import tower_runs_without_items
        from hyperpar.models.output import ModelOutput

        levels: dict[int, torch.Tensor] = {}
        with record_router_stats() as sink:
            if self.pp_is_first:
                lo = int(row_index[0])
                vision = self.pp_vision.rows(lo, int(row_index[-1]) + 1) if self.pp_vision else {}
                with tower_runs_without_items(not vision and lo in self.pp_idle_tower_rows):
                    x, visual_mask, features = self.stage_embed(x, position_ids=position_ids,
                                                                attention_mask=attention_mask, **vision)
                embeds = x
                levels = dict(enumerate(features))
            else:
                embeds = received.get("embeds")
                for name, dense in received.items():
                    if name.startswith("deepstack."):
                        levels[int(name.split(".", 1)[1])] = dense[visual_mask]
            deepstack = [levels.get(n) for n in range(max(levels) + 1)] if levels else []
            h = self.stage_text(x, position_ids, attention_mask, visual_mask, deepstack)
            if self.pp_is_last:
                logits = self.lm_head(h)
                mtp_logits = None
                if getattr(self, "mtp_active", False):
                    lm = text_stack(self)
                    mtp_logits = self.lm_head(self.mtp.predict(embeds, h, lm.rotary_emb, position_ids, attention_mask))
        if self.pp_is_last:
            return self._last_outputs(ModelOutput.of(logits, sink, float(getattr(text_args(self.args), "router_aux_loss_coef", 0.0)), mtp_logits),
                                      stats)
        carry: dict[str, torch.Tensor] = {}
        for name in self.pp_carry_out:
            if name in received:  # passed on (a copy, see _send: the stage's output has its own autograd node)
                carry[name] = received[name].clone()
            elif name == "embeds":
                carry[name] = embeds.full_tensor() if isinstance(embeds, DTensor) else embeds
            else:  # a DeepStack level this (first) stage computed, dense over the positions
                n = int(name.split(".", 1)[1])
                H = text_args(self.args).hidden_size
                B, S = row_index.shape[0], position_ids.shape[-1]
                dense = torch.zeros(B, S, H, dtype=h.dtype, device=h.device)
                if visual_mask is not None and n in levels:
                    dense = dense.masked_scatter(visual_mask.unsqueeze(-1), levels[n].to(dense.dtype))
                carry[name] = dense
        return self._send(h, sink, stats, carry)


def shares_embedding(args) -> bool:
    """The last stage needs the embedding too: a tied head, or (text models) a trained MTP module
    that embeds tokens; a VL model's MTP module reads the merged embeddings carried from the first stage."""
    from hyperpar.distributed.pipeline_vl import is_vl

    if bool(getattr(args, "tie_word_embeddings", False)):
        return True
    return not is_vl(args) and (
        int(getattr(args, "mtp_num_hidden_layers", 0)) > 0 and float(getattr(args, "mtp_loss_weight", 0.0)) > 0)


def keep_stats_fp32(stage: nn.Module) -> None:
    """After FSDP: its root casts floating inputs to the compute dtype, which would round the router
    counts in bf16; this hook, ahead of FSDP's, hands forward the received fp32 vector itself (the
    tensor the schedule differentiates against, so gradients still reach the previous stage)."""
    def keep(module: nn.Module, args: tuple) -> None:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            module.__dict__["_pp_stats_fp32"] = args[1]

    if stage.pp_num_experts:
        stage.register_forward_pre_hook(keep, prepend=True)


def as_stage(model: nn.Module, layers: range, *, is_first: bool, is_last: bool) -> nn.Module:
    """Delete from ``model`` (meta) what this stage does not run and give it the stage forward.

    The class is swapped for a subclass (as FSDP does), so the module keeps its names, its family
    (``spec_of_model``) and its init/export hooks."""
    from hyperpar.distributed.pipeline_vl import is_vl

    text = text_stack(model)
    for key in list(text.layers.keys()):
        if int(key) not in layers:
            del text.layers[key]
    if not is_first and not (is_last and shares_embedding(model.args)):
        text.embed_tokens = None
    vl = is_vl(model.args)
    if vl and not is_first:
        model.model.visual = None
    if not is_last:
        text.norm = None
        model.lm_head = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None
    cls = type(model)
    model.__class__ = type(f"Stage{cls.__name__}", (StageForward, cls), {})
    model.pp_num_experts = int(getattr(text_args(model.args), "num_experts", 0) or 0)
    model.pp_is_first, model.pp_is_last, model.pp_vl = is_first, is_last, vl
    model.pp_layers = layers
    return model


# ---- the embedding on both ends ----------------------------------------------------------------------


class SharedEmbedding:
    """The embedding on the first stage is used on the last too (tied head, MTP): each end holds a
    copy (same name, so the same init or checkpoint tensor; same updates) and the gradients are
    summed over the two."""

    def __init__(self, pdims, parts: list[nn.Module], stage_ids: list[int]) -> None:
        self.params: list[nn.Parameter] = []  # this rank's copy
        self.duplicate: set[int] = set()  # ids of the copies gradient clipping must not count again
        self.group = None
        if not shares_embedding(parts[0].args):  # the same on every rank: the groups are built collectively
            return
        ranks = pdims.mesh.mesh.reshape(pdims.pp, -1)  # pp is the outermost mesh axis
        pairs = [[int(ranks[0, c]), int(ranks[-1, c])] for c in range(ranks.shape[1])]
        # new_group is collective: every rank builds every pair's group and keeps its own.
        self.group, _ = dist.new_subgroups_by_enumeration(pairs)
        for part, sid in zip(parts, stage_ids):
            embed = text_stack(part).embed_tokens
            if embed is not None:
                self.params.append(embed.weight)
                if sid != 0:
                    self.duplicate.add(id(embed.weight))

    @torch.no_grad()
    def sum_grads(self) -> None:
        from torch.distributed.tensor import DTensor

        for p in self.params:  # the two ends are on different pp ranks
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=self.group)


# ---- schedules --------------------------------------------------------------------------------------


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn, kwargs_chunk_spec: dict | None = None):
    """A torch.distributed.pipelining schedule; our objective already divides by the global token
    count, so the schedule must not scale gradients by the micro-batch count."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    try:
        if name in single:
            if len(stages) != 1:
                raise PlanError(f"parallel.pp_schedule={name} runs one stage per rank, not vpp {len(stages)}",
                                hint="use pp_schedule=interleaved_1f1b with parallel.vpp > 1")
            return single[name](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False,
                                kwargs_chunk_spec=kwargs_chunk_spec)
        if name == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False,
                                           kwargs_chunk_spec=kwargs_chunk_spec)
        if name == "zero_bubble":
            from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

            # backward split into the input-gradient pass (sent on at once) and the weight-gradient
            # pass (run later, where 1F1B would idle); looped placement like interleaved_1f1b
            return ScheduleInterleavedZeroBubble(stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                 scale_grads=False, kwargs_chunk_spec=kwargs_chunk_spec)
    except ValueError as e:  # torch's own checks of the micro-batch count
        raise PlanError(f"pipeline schedule {name}: {e}", hint="change train.pp_microbatches") from None
    raise PlanError(f"parallel.pp_schedule={name} not supported", hint="use gpipe, 1f1b, interleaved_1f1b or zero_bubble")


# ---- what the plan refuses --------------------------------------------------------------------------


@dataclass
class PipelineJob:
    """The pipeline settings of a job, checked before any worker starts."""

    schedule: str
    microbatches: int
    layers: list[int]  # decoder layers per (virtual) stage

    def describe(self) -> str:
        return f"{len(self.layers)} stages, layers {self.layers}, schedule {self.schedule}, {self.microbatches} micro-batches per step"

    @classmethod
    def check(cls, cfg, pdims, model_name: str, args) -> "PipelineJob | None":
        from hyperpar.plan import check_pp_schedule

        if pdims.pp == 1:
            return None
        schedule = check_pp_schedule(cfg.parallel.pp_schedule)
        if model_name not in PP_FAMILIES:
            raise PlanError(f"pp for {model_name} not supported yet", hint=f"pipeline parallel trains {', '.join(PP_FAMILIES)}")
        if schedule != "zero_bubble" and (schedule == "interleaved_1f1b") != (pdims.vpp > 1):
            raise PlanError(f"parallel.pp_schedule={schedule} with vpp {pdims.vpp}: interleaved_1f1b needs vpp > 1, "
                            "gpipe and 1f1b need vpp 1")
        t = cfg.train
        if schedule == "zero_bubble" and t.activation_checkpoint == "selective":
            # the weight-gradient pass backs through each block a second time; selective AC's saved
            # outputs are consumed by the first pass (torch: "backward an extra time")
            raise PlanError("parallel.pp_schedule=zero_bubble with train.activation_checkpoint=selective not supported "
                            "(its weight-gradient pass backs through each block a second time)",
                            hint="use activation_checkpoint=full or none, or another pp_schedule")
        if pdims.ep > 1 and t.activation_checkpoint == "selective":
            # the experts are an FSDP unit inside each checkpointed block: with a stage's micro-batches
            # all forwarded before their backwards, the recompute all-gathers them where the forward did not
            raise PlanError("pp with ep and train.activation_checkpoint=selective not supported "
                            "(the experts' FSDP all-gather runs in the recompute but not in the forward)",
                            hint="use activation_checkpoint=full or none")
        local_rows = t.global_batch_size // pdims.dp
        n = int(t.pp_microbatches) if t.pp_microbatches else local_rows // t.micro_batch_size
        if n < 1 or local_rows % n:
            raise PlanError(f"train.pp_microbatches={n} must divide the {local_rows} rows per data-parallel rank")
        if schedule != "gpipe" and n < pdims.pp:
            raise PlanError(f"pp_schedule={schedule} needs at least pp={pdims.pp} micro-batches, got {n}",
                            hint="raise train.pp_microbatches or the global batch, or use pp_schedule=gpipe")
        layers = stage_layer_counts(text_args(args).num_hidden_layers, pdims.pp * pdims.vpp, list(pdims.pp_layers or []) or None)
        return cls(schedule=schedule, microbatches=n, layers=layers)
