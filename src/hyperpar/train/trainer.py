"""Trainer: the optimizer-step loop (gradient accumulation, global token-mean loss, clipping, metrics)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyperpar.distributed.dp_vocab import reduce_replicas
from hyperpar.distributed.one_rank_cast import settle
from hyperpar.distributed.pipeline_vl import is_vl
from hyperpar.distributed.vision_sync import has_vision, idle_tower_forwards
from hyperpar.errors import TrainingError
from hyperpar.models.layers.moe import record_routes
from hyperpar.models.multimodal import tower_runs_without_items
from hyperpar.train.objective import Objective
from hyperpar.train.metrics import MetricsWriter
from hyperpar.train.optim import clip_grad_norm
from hyperpar.train.profiler import StepProfiler, phase
from hyperpar.train.routes import RouteMonitor

log = logging.getLogger("hyperpar")

# Global batches without one labelled token are skipped (a prompt longer than train.seq_len, an
# all-masked SFT sample); this many in a row means the data's loss masking is wrong, and the run stops.
MAX_UNLABELLED_IN_ROW = 8


def _model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "labels"}


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loader,
        parallel_dims,
        device_info,
        device: torch.device,
        run_dir: str,
        steps: int,
        max_grad_norm: float,
        flops_per_token: float,
        peak_flops: float | None,
        rank: int,
        metrics: MetricsWriter | None = None,
        checkpointer: Any = None,
        stop_after_steps: int | None = None,
        preemption: Any = None,
        mtp_loss_weight: float = 0.0,
        objective: Objective | None = None,
        pipeline: Any = None,
        profiler: StepProfiler | None = None,
        route_counts: bool = False,
    ) -> None:
        self.model = model
        # The list of model parts (one without pipeline parallelism): clipping, gradient sync and
        # checkpoint state work on every part.
        self.model_parts: list[nn.Module] = [model]
        self.objective = objective if objective is not None else Objective(mtp_weight=mtp_loss_weight)
        # A train/pipeline_step.PipelineStep: the step's forward/backward runs through its schedule.
        self.pipeline = pipeline
        if pipeline is not None:
            self.model_parts = pipeline.parts
            pipeline.finish_setup(self.objective)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.pdims = parallel_dims
        self.device_info = device_info
        self.device = device
        self.run_dir = run_dir
        self.steps = steps
        self.max_grad_norm = max_grad_norm
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.rank = rank
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.stop_after_steps = stop_after_steps
        self.preemption = preemption  # has ``.requested`` (set by SIGTERM), see checkpoint/preemption.py
        self.stop_reason: str | None = None
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.samples_seen = 0
        self.unlabelled_in_row = 0  # consecutive skipped global batches (see MAX_UNLABELLED_IN_ROW)
        self.loss_group = parallel_dims.submesh("dp_cp").get_group()
        # VL: the ranks whose vision towers run their FSDP collectives together (see vision_sync).
        self.vision_group = self.loss_group if pipeline is None and is_vl(getattr(model, "args", None)) else None
        self.history: list[float] = []
        self.profiler = profiler  # profile.steps: torch.profiler around those steps
        # MoE: where the routers sent each step's tokens (route_hash / route_margin / route_counts)
        self.routes = RouteMonitor.for_model(self.model_parts, parallel_dims.tp, device, counts=route_counts)

    def _sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size(self.loss_group) > 1:
            dist.all_reduce(value, group=self.loss_group)
        return value

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.device_info.reset_peak_memory()
        with phase("data"):
            micro_batches = self.loader.next_step()
        n = len(micro_batches)
        # The aux loss is a per-forward statistic: averaged over every micro-batch of the global
        # batch, which is the same set of micro-batches in any layout with the same micro-batch size.
        labels = [self.objective.targets(mb["labels"], mb.get("position_ids"), mb.get("attention_mask")).to(self.device)
                  for mb in micro_batches]
        # Every position the model runs over, labelled or not (padding, masked prompts): what the
        # throughput and the model FLOPs count; ``tokens`` is the labelled ones (the loss's denominator).
        positions = self.loader.global_batch_size * (labels[0].shape[-1] if labels else 0)
        totals = self.objective.totals(labels, n * self.loader.dp_size, self._sum_over_dp)
        if totals.tokens.item() == 0:
            return self._skip_unlabelled(t0)
        self.unlabelled_in_row = 0
        with phase("forward_backward"), record_routes() if self.routes else contextlib.nullcontext() as routes:
            loss_sum, aux_sum, mtp_sum, saw_aux, saw_mtp = self._forward_backward(micro_batches, labels, totals)
        settle(self.model_parts)  # one-rank casts: fp32 parameters and gradients (each backward's end restored them)
        reduce_replicas(self.model_parts)  # HSDP: the vocabulary-sharded weights' gradients, over the replicas
        with phase("clip_grad"):
            if self.pipeline is not None:
                grad_norm = self.pipeline.clip_grad_norm(self.max_grad_norm)
            else:
                grad_norm = clip_grad_norm([p for part in self.model_parts for p in part.parameters()],
                                           self.max_grad_norm)
        global_tokens = totals.tokens
        loss = (self._sum_over_dp(loss_sum) / global_tokens).item()
        extra: dict[str, float] = {}
        if saw_aux:
            extra["aux_loss"] = (self._sum_over_dp(aux_sum) / totals.micro_batches).item()
        if saw_mtp and totals.mtp_tokens is not None:
            extra["mtp_loss"] = (self._sum_over_dp(mtp_sum) / totals.mtp_tokens).item()
        if self.routes is not None:
            extra.update(self.routes.summary(routes))
        if not math.isfinite(loss) or not math.isfinite(grad_norm.item()):
            raise TrainingError(
                f"non-finite loss at step {self.step + 1}: loss={loss}, grad_norm={grad_norm.item()}",
                hint="lower optim.lr, enable clipping (train.max_grad_norm) or use float32",
            )
        lr = self.optimizer.param_groups[0]["lr"]
        with phase("optimizer"):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.device_info.synchronize()
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = int(global_tokens.item())
        self.tokens_seen += tokens
        self.samples_seen += self.loader.global_batch_size
        tps = positions / dt
        world = self.pdims.world_size
        mfu = self.flops_per_token * tps / (self.peak_flops * world) if self.peak_flops else None  # unknown peak
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": float(grad_norm.item()),
            "lr": float(lr),
            "tokens": tokens,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "peak_mem_mb": self.device_info.peak_memory_mb(),
            "page_faults": self.device_info.page_faults(),
            "mfu": mfu,
            **extra,
        }

    def _forward_backward(self, micro_batches: list[dict], labels: list[torch.Tensor], totals: Any
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool]:
        """Every micro-batch's forward and backward (through the schedule under pp); the local sums of
        the token loss, aux loss and MTP loss, and whether the model gave the last two."""
        if self.pipeline is not None:
            return self.pipeline.forward_backward(micro_batches, totals, self.loader.dp_size)
        n = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        aux_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        mtp_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        saw_aux = saw_mtp = False
        idle_tower = idle_tower_forwards([has_vision(mb) for mb in micro_batches], self.vision_group, self.device)
        for i, mb in enumerate(micro_batches):
            for part in self.model_parts:
                if hasattr(part, "set_requires_gradient_sync"):
                    # Reduce gradients once per optimizer step, after the last micro-batch.
                    part.set_requires_gradient_sync(i == n - 1)
            with self.objective.context(), tower_runs_without_items(idle_tower[i]):
                out = self.model(**_model_inputs(mb, self.device))
                objective, parts = self.objective(out, labels[i], totals, logit_grad_in_forward=True)
                del out  # the logits: their gradient is formed, nothing reads them in the backward
                objective.backward()
            loss_sum += parts.lm_sum
            if parts.aux is not None:
                aux_sum += parts.aux
                saw_aux = True
            if parts.mtp_sum is not None:
                mtp_sum += parts.mtp_sum
                saw_mtp = True
        return loss_sum, aux_sum, mtp_sum, saw_aux, saw_mtp

    def _skip_unlabelled(self, t0: float) -> dict[str, Any]:
        """A step whose global batch has no labelled token: no forward, no update (its loss would be
        0 / 0); the step, the data position and the LR schedule move on as for any step, so a resume
        and a layout with other micro-batch sizes skip the same batch."""
        self.unlabelled_in_row += 1
        if self.unlabelled_in_row >= MAX_UNLABELLED_IN_ROW:
            raise TrainingError(f"step {self.step + 1}: {self.unlabelled_in_row} global batches in a row have no "
                                "token with a label", hint="check the data's loss masking (e.g. chat prompts longer "
                                "than train.seq_len)")
        log.warning("step %d: the global batch has no token with a label; skipped (no update)", self.step + 1)
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # torch's "scheduler before optimizer" when the first step is skipped
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            self.scheduler.step()
        self.step += 1
        self.samples_seen += self.loader.global_batch_size
        return {"step": self.step, "skipped": "no labelled token", "lr": float(lr), "tokens": 0,
                "tokens_seen": self.tokens_seen, "step_time_s": time.perf_counter() - t0}

    def counters(self) -> dict[str, int]:
        """The loop's position, saved in checkpoints (consumed samples and tokens continue on resume)."""
        return {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}

    def load_counters(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state.get("samples_seen", self.step * self.loader.global_batch_size))
        self.tokens_seen = int(state.get("tokens_seen", 0))

    def _check_stop(self) -> str | None:
        """Why the loop ends after this step, agreed by all ranks (one tiny all-reduce per step)."""
        requested = bool(self.preemption is not None and self.preemption.requested)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if requested else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            requested = bool(flag.item() > 0)
        if requested:  # "stopped" for Ctrl-C on a rank that got it; a peer only knows that some rank did
            return (self.preemption.reason if self.preemption is not None else None) or "preempted"
        if self.stop_after_steps is not None and self.stop_after_steps > 0 and self.step >= self.stop_after_steps:
            return "stop_after_steps"
        return None

    def fit(self) -> dict[str, Any]:
        from hyperpar.checkpoint.preemption import fault_hook_after_step

        log.info("training for %d steps (starting at step %d)", self.steps, self.step)
        warmup = getattr(getattr(self.scheduler, "lr_lambdas", [None])[0], "keywords", {}).get("warmup_steps", 0)
        if warmup > self.steps:
            log.warning("optim.warmup_steps=%d > train.steps=%d: the run ends inside the warmup (its last step at "
                        "%.3g x optim.lr)", warmup, self.steps, self.steps / warmup)
        if self.step >= self.steps > 0:
            log.warning("nothing to train: the resumed checkpoint is at step %d, train.steps=%d (raise train.steps "
                        "to train on)", self.step, self.steps)
        if self.stop_after_steps is not None and 0 < self.stop_after_steps <= self.step:
            self.stop_reason = "stop_after_steps"
        while self.step < self.steps and self.stop_reason is None:
            with self.profiler.around(self.step + 1) if self.profiler else contextlib.nullcontext({}) as box:
                record = self.train_step()
                box["record"] = record
            if "loss" in record:  # a skipped step (no labelled token) has none
                self.history.append(record["loss"])
            if self.metrics is not None:
                self.metrics.write(record)
            fault_hook_after_step(self.step, self.rank, self.pdims.world_size)
            self.stop_reason = self._check_stop()
            if self.checkpointer is not None:
                self.checkpointer.after_step(self)
        if self.stop_reason is not None:
            log.info("stopping after step %d of %d (%s)", self.step, self.steps, self.stop_reason)
        if self.checkpointer is not None:
            self.checkpointer.at_end(self)
        return {"steps": self.step, "final_loss": self.history[-1] if self.history else None, "losses": self.history,
                "stop_reason": self.stop_reason}
