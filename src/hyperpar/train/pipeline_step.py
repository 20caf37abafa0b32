"""The pipeline-parallel part of a training step: the model parts of this rank's stages, the
schedule, and the forward/backward of one optimizer step through it.

The schedule's ``loss_fn`` is the step's ``Objective`` (token CE over the step's global token count,
aux over its global micro-batch count), so the gradients equal the non-pipelined step's for any
micro-batch count. The logged sums are the last stage's, sent to every rank of the pipeline.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from hyperpar.distributed.pipeline import (
    PipelineJob,
    SharedEmbedding,
    as_stage,
    build_schedule,
    keep_stats_fp32,
    local_stage_ids,
    shares_embedding,
    stage_ranges,
    text_args,
    unpack_stats,
)
from hyperpar.distributed import pipeline_vl
from hyperpar.distributed.vision_sync import idle_tower_forwards
from hyperpar.models.layers.moe import active_route_record
from hyperpar.models.output import ModelOutput
from hyperpar.train.objective import MicroBatchLoss, Objective, StepTotals
from hyperpar.train.optim import clip_grad_norm

log = logging.getLogger("hyperpar")


def _batch_dim(key: str, t: torch.Tensor) -> int:
    return 1 if key == "position_ids" and t.ndim == 3 else 0  # (3|4, B, S) mRoPE rows


class PipelineStep:
    def __init__(self, builder, pdims, cfg, device: torch.device) -> None:
        job = PipelineJob.check(cfg, pdims, cfg.model.name, builder.args)
        self.schedule_name, self.n_microbatches = job.schedule, job.microbatches
        self.pdims, self.device = pdims, device
        self.num_stages = pdims.pp * pdims.vpp
        pp_rank = pdims.submesh("pp").get_local_rank()
        self.stage_ids = local_stage_ids(pp_rank, pdims.pp, pdims.vpp)
        args = builder.args
        ranges = stage_ranges(text_args(args).num_hidden_layers, self.num_stages, list(pdims.pp_layers or []) or None)
        self.vl = pipeline_vl.is_vl(args)
        self.args = args
        mtp_vl = self.vl and float(getattr(args, "mtp_loss_weight", 0.0)) > 0 and getattr(text_args(args), "mtp_num_hidden_layers", 0) > 0
        carry = pipeline_vl.carry_plan(ranges, args, mtp_vl) if self.vl else [[] for _ in ranges[1:]]
        self.parts: list[nn.Module] = []
        for sid in self.stage_ids:
            part = as_stage(builder.build_meta(), ranges[sid], is_first=sid == 0, is_last=sid == self.num_stages - 1)
            part.pp_carry_in = tuple(carry[sid - 1]) if sid > 0 else ()
            part.pp_carry_out = tuple(carry[sid]) if sid < self.num_stages - 1 else ()
            self.parts.append(builder.spec.parallelize(part, pdims, cfg))  # TP -> CP -> EP -> AC -> FSDP, per stage
            if pdims.tp > 1 and pdims.sequence_parallel:
                self.parts[-1].pp_stream_mesh = pdims.tp_mesh()
            keep_stats_fp32(self.parts[-1])
        log.info("pipeline: %d stages (%s), this rank runs %s with layers %s; %d micro-batches per step",
                 self.num_stages, self.schedule_name, self.stage_ids, [list(ranges[s]) for s in self.stage_ids],
                 self.n_microbatches)
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.shared: SharedEmbedding | None = None
        self.schedule = None
        self.objective: Objective | None = None
        self.totals: StepTotals | None = None
        self.parts_log: list[MicroBatchLoss] = []

    def finish_setup(self, objective: Objective) -> None:
        """After the parts are materialised: the shared-embedding groups (collective) and the objective."""
        self.objective = objective
        self.shared = SharedEmbedding(self.pdims, self.parts, self.stage_ids)

    # ---- the schedule ----------------------------------------------------------------------
    def _loss_fn(self, output, labels: torch.Tensor) -> torch.Tensor:
        part = self.parts[-1]
        if isinstance(output, tuple):  # MoE: logits, the micro-batch's statistics of every stage (, MTP logits)
            logits, packed, *mtp = output
            out = ModelOutput(logits, unpack_stats(packed, part.pp_num_experts), float(text_args(part.args).router_aux_loss_coef),
                              mtp[0] if mtp else None)
        else:
            out = output
        objective, parts = self.objective(out, labels, self.totals)
        self.parts_log.append(parts)
        return objective

    def _build(self, kwargs: dict[str, torch.Tensor]) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.microbatch import TensorChunkSpec

        group = self.pdims.submesh("pp").get_group()
        stages = [PipelineStage(part, sid, self.num_stages, self.device, group=group)
                  for part, sid in zip(self.parts, self.stage_ids)]
        self.stages = stages
        chunks = {k: TensorChunkSpec(_batch_dim(k, v)) for k, v in kwargs.items()}
        self.schedule = build_schedule(self.schedule_name, stages, self.n_microbatches, self._loss_fn, chunks)

    # ---- one optimizer step ------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], totals: StepTotals, dp_size: int):
        """Run the step's micro-batches through the schedule; returns the sums (lm loss, aux, MTP loss)
        of this rank's data and whether aux / MTP ran, equal on every stage."""
        vision = None
        if self.vl:  # images are ragged: they stay out of the schedule (see pipeline_vl)
            rows, vision = pipeline_vl.step_inputs(micro_batches, self.args)
            rows["row_index"] = torch.arange(rows["input_ids"].shape[0])
            if pipeline_vl.deepstack_levels(self.args):
                rows["visual_mask"] = pipeline_vl.visual_mask(rows["input_ids"], self.args)
            rows = {k: v.to(self.device) for k, v in rows.items()}
            for part in self.parts:
                part.pp_vision = vision.to(self.device) if vision is not None and part.pp_is_first else None
            if 0 in self.stage_ids:
                self._mark_idle_towers(rows["input_ids"].shape[0], vision)
        else:
            rows = {k: torch.cat([mb[k] for mb in micro_batches], dim=_batch_dim(k, micro_batches[0][k])).to(self.device)
                    for k in micro_batches[0]}
        labels = self.objective.targets(rows.pop("labels"), rows.get("position_ids"), rows.get("attention_mask"))
        input_ids = rows.pop("input_ids")
        if self.pdims.cp > 1 and "position_ids" not in rows:
            # every stage's CP hooks build rotary tables and documents from whole-row positions
            B, S = input_ids.shape
            rows["position_ids"] = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S).contiguous()
        if not self.vl and shares_embedding(self.parts[0].args) and getattr(self.parts[0].args, "mtp_loss_weight", 0) > 0:
            rows["token_ids"] = input_ids  # the last stage's MTP module embeds them
        # torch's schedule pairs the inputs with its first step's chunk specs in flattening order,
        # not by name: one key order for every step, whatever order a data source gives them in.
        rows = dict(sorted(rows.items()))
        if self.schedule is None:
            self._build(rows)
        self.totals = dataclasses.replace(totals, micro_batches=self.n_microbatches * dp_size)
        self.parts_log = []
        first = 0 in self.stage_ids
        with self.objective.context():
            if first:
                self.schedule.step(input_ids, target=labels if self.has_last else None, return_outputs=False, **rows)
            else:
                self.schedule.step(target=labels if self.has_last else None, return_outputs=False, **rows)
        self.shared.sum_grads()
        routes = active_route_record()
        for part in self.parts:  # MoE routes of the micro-batches' forwards (not the shape inference's)
            log = part.__dict__.pop("pp_route_log", [])
            if routes is not None:
                for rec in log[-self.n_microbatches:]:
                    routes.add(rec)
        # The schedule's shape inference may have run the loss once before the micro-batches.
        logged = self.parts_log[-self.n_microbatches:] if self.has_last else []
        sums = torch.zeros(5, dtype=torch.float32, device=self.device)  # lm, aux, mtp, saw aux, saw mtp
        for p in logged:
            sums[0] += p.lm_sum
            if p.aux is not None:
                sums[1] += p.aux
                sums[3] = 1.0
            if p.mtp_sum is not None:
                sums[2] += p.mtp_sum
                sums[4] = 1.0
        if self.pdims.pp > 1:  # from the last stage's ranks to every stage
            dist.all_reduce(sums, group=self.pdims.submesh("pp").get_group())
        # The trainer divides the aux sum by its micro-batch count (the loader's), ours may differ.
        aux = sums[1] * len(micro_batches) / self.n_microbatches
        return sums[0], aux, sums[2], bool(sums[3].item() > 0), bool(sums[4].item() > 0)

    def _mark_idle_towers(self, n_rows: int, vision) -> None:
        """The first stage's micro-batches that run the vision tower without images, because
        another data-parallel rank's same micro-batch has some (see distributed/vision_sync)."""
        chunks = torch.arange(n_rows).tensor_split(self.n_microbatches)  # the schedule's split
        local = [vision is not None and vision.has_items(int(c[0]), int(c[-1]) + 1) for c in chunks]
        idle = idle_tower_forwards(local, self.pdims.submesh("dp_cp").get_group(), self.device)
        for part in self.parts:
            part.pp_idle_tower_rows = frozenset(int(c[0]) for c, i in zip(chunks, idle) if i)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        skip = self.shared.duplicate
        params = [p for part in self.parts for p in part.parameters() if id(p) not in skip]
        # The last stage's copy of a shared embedding is counted once in the norm but clipped like
        # the first stage's: clipping one copy only let the two (equal gradients) drift apart.
        copies = [p for part in self.parts for p in part.parameters() if id(p) in skip]
        return clip_grad_norm(params, max_norm, pp=self.pdims.pp, uncounted=copies)

    @property
    def optim_model(self) -> nn.Module:
        """What the optimizer builder iterates: the one part, or all of this rank's parts."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)
