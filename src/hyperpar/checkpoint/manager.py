"""Checkpointer: periodic atomic saves, resume (explicit, automatic, after an elastic restart), HF export.

Built from the ``checkpoint`` config group by :func:`build_checkpointer`; the Trainer calls
``after_step`` after every optimizer step and ``at_end`` when its loop ends. The worker calls
``resume`` once before training.

Resume rules, first match wins:
  1. ``resume: auto``, or a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, whatever ``resume``
     says): the newest complete checkpoint of this run's ``checkpoints/`` directory;
  2. ``load_path``: that checkpoint (or the newest complete one under a run / checkpoints directory);
  3. otherwise a fresh start.
``enabled`` only controls saving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from hyperpar.checkpoint import directory as d
from hyperpar.checkpoint import state as st
from hyperpar.checkpoint.preemption import fault_hook_in_save
from hyperpar.errors import CheckpointError, ConfigError, HyperparError

log = logging.getLogger("hyperpar")

RESUME_MODES = ("auto", "never")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _model_tag(cfg: DictConfig | None) -> str | None:
    if cfg is None or "model" not in cfg:
        return None
    m = cfg.model
    src = f"hf_path={m.hf_path}" if m.get("hf_path") else f"flavor={m.get('flavor')}"
    return f"{m.name} ({src})"


class Checkpointer:
    def __init__(
        self,
        *,
        enabled: bool = True,
        save_steps: int = 0,
        keep_last: int = 2,
        load_path: str | None = None,
        resume: str = "auto",
        async_save: bool = False,
        export_hf_at_end: bool = False,
        run_dir: str,
        job_cfg: DictConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        device_type: str = "cpu",
        restart_count: int | None = None,
    ) -> None:
        if resume not in RESUME_MODES:
            raise ConfigError(f"checkpoint.resume='{resume}' is not one of {', '.join(RESUME_MODES)}")
        if save_steps < 0:
            raise ConfigError(f"checkpoint.save_steps={save_steps} must be >= 0 (0: save only at the end)")
        if keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={keep_last} must be >= 0 (0: keep all)")
        self.enabled = enabled
        self.save_steps = save_steps
        self.keep_last = keep_last
        self.load_path = load_path
        self.resume_mode = resume
        self.async_save = async_save
        self.export_hf_at_end = export_hf_at_end
        self.run_dir = Path(run_dir)
        self.root = d.checkpoints_dir(run_dir)
        self.job_cfg = job_cfg
        self.rank = rank
        self.world_size = world_size
        self.device_type = device_type
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if restart_count is None else restart_count
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self._pending: tuple[Any, int, Path] | None = None  # async: (future, step, tmp dir)
        self._async_group = None
        if enabled and async_save and dist.is_available() and dist.is_initialized():
            # Background saves run their collectives on their own gloo group so they never interleave
            # with the training collectives of the default group.
            self._async_group = dist.new_group(backend="gloo")

    # ---- resume -------------------------------------------------------------------------------
    def _choose(self) -> Path | None:
        if self.resume_mode == "auto" or self.restart_count > 0:
            stale = d.incomplete(self.root)
            if stale:
                log.warning("ignoring incomplete checkpoint(s) (interrupted saves): %s", ", ".join(p.name for p in stale))
            newest = d.newest_complete(self.root)
            if newest is not None:
                return newest
        if self.load_path:
            return d.resolve_load_path(self.load_path)
        return None

    def choose_resume(self) -> Path | None:
        """The checkpoint to resume from; rank 0 decides so every rank loads the same one."""
        if not _dist():
            return self._choose()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                path = self._choose()
                box[0] = ("ok", str(path) if path else None)
            except HyperparError as e:
                box[0] = ("error", type(e).__name__, str(e), e.hint)
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            _, kind, msg, hint = box[0]
            cls = {c.__name__: c for c in (CheckpointError, ConfigError)}.get(kind, CheckpointError)
            raise cls(msg, hint=hint)
        return Path(box[0][1]) if box[0][1] else None

    def resume(self, trainer) -> int | None:
        """Load the chosen checkpoint into ``trainer`` (model, optimizer, schedule, loader, counters, RNG)."""
        path = self.choose_resume()
        if path is None:
            if self.restart_count > 0:
                log.warning("restart %d found no complete checkpoint: training starts over", self.restart_count)
            return None
        self.load(path, trainer)
        return trainer.step

    def load(self, path: Path, trainer) -> None:
        path = Path(path)
        train_state = d.read_json(path / d.TRAIN_STATE, "trainer state")
        metadata = st.read_metadata(path)
        st.check_files(path, metadata)
        tensors, optim_other = st.split_state(trainer.model, trainer.optimizer)
        saved_model = train_state.get("model")
        st.check_compatible(path, metadata, tensors, saved_model, _model_tag(self.job_cfg) or "")
        st.load_tensors(path, tensors)
        st.apply_model_optim(trainer.model, trainer.optimizer, tensors, optim_other, train_state.get("optim_param_groups", {}))
        try:
            trainer.scheduler.load_state_dict(train_state["scheduler"])
            trainer.load_counters(train_state["counters"])
            trainer.loader.load_state_dict(train_state["loader"])
        except KeyError as e:
            raise CheckpointError(f"checkpoint file '{path / d.TRAIN_STATE}' lacks {e}") from None
        except ValueError as e:
            raise CheckpointError(f"cannot resume from '{path}': {e}", hint="keep train.global_batch_size") from None
        rng_file = path / d.RNG_DIR / f"rank_{self.rank:05d}.json"
        if train_state.get("world_size") == self.world_size and rng_file.is_file():
            st.set_rng_state(d.read_json(rng_file, "RNG state"), self.device_type)
        else:
            log.info("RNG state not restored (saved by %s ranks, now %d): generators keep this run's seeding",
                     train_state.get("world_size"), self.world_size)
        if path.parent.resolve() == self.root.resolve():
            self.last_saved_step = trainer.step
        self.resumed_from = path
        log.info("resumed from %s at step %d (saved by layout %s, %s ranks)", path, trainer.step,
                 train_state.get("layout"), train_state.get("world_size"))

    # ---- save ---------------------------------------------------------------------------------
    def after_step(self, trainer) -> None:
        if self.enabled and self.save_steps > 0 and trainer.step % self.save_steps == 0:
            self.save(trainer)

    def at_end(self, trainer) -> None:
        """Save the final (or preempted) step, wait for a background save, export when training completed."""
        if self.enabled and self.last_saved_step != trainer.step and trainer.step > 0:
            self.save(trainer)
        self.wait()
        if self.export_hf_at_end and trainer.step >= trainer.steps:
            self.export_hf(trainer)

    def _train_state(self, trainer, optim_other: dict[str, Any]) -> dict[str, Any]:
        cfg = self.job_cfg
        return {
            "format": st.FORMAT,
            "step": trainer.step,
            "counters": trainer.counters(),
            "scheduler": st.to_json_value(trainer.scheduler.state_dict()),
            "loader": st.to_json_value(trainer.loader.state_dict()),
            "optim_param_groups": st.to_json_value(optim_other),
            "model": _model_tag(cfg),
            "layout": cfg.parallel.name if cfg is not None and "parallel" in cfg else None,
            "world_size": self.world_size,
            "total_steps": trainer.steps,
        }

    def save(self, trainer) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()
        step = trainer.step
        tmp = self.root / f"{d.step_name(step)}.tmp"
        if self.rank == 0:
            d.prepare_tmp(self.root, step)
        _barrier()
        tensors, optim_other = st.split_state(trainer.model, trainer.optimizer)
        if self.rank == 0:
            d.write_json(tmp / d.TRAIN_STATE, self._train_state(trainer, optim_other))
            if self.job_cfg is not None:
                OmegaConf.save(self.job_cfg, tmp / d.CONFIG, resolve=True)
        d.write_json(tmp / d.RNG_DIR / f"rank_{self.rank:05d}.json", st.rng_state(self.device_type))
        self.last_saved_step = step
        if self.async_save:
            fut = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = (fut, step, tmp)
            log.info("saving checkpoint step %d in the background", step)
            return tmp
        dcp.save(tensors, checkpoint_id=str(tmp))
        return self._publish(step, tmp)

    def _publish(self, step: int, tmp: Path) -> Path:
        fault_hook_in_save(step)
        _barrier()  # every rank's files are written
        final = self.root / d.step_name(step)
        if self.rank == 0:
            marker = {"world_size": self.world_size, "model": _model_tag(self.job_cfg)}
            final = d.publish(tmp, step, marker)
            removed = d.prune(self.root, self.keep_last, keep=final)
            log.info("saved checkpoint %s%s", final,
                     f" (removed {', '.join(p.name for p in removed)})" if removed else "")
        _barrier()  # nobody starts the next save (or exits) before it is visible
        return final

    def wait(self) -> None:
        """Finish a background save: wait for its writes on every rank, then publish it."""
        if self._pending is None:
            return
        fut, step, tmp = self._pending
        self._pending = None
        result = getattr(fut, "upload_completion", fut)
        result.result()
        self._publish(step, tmp)

    # ---- export -------------------------------------------------------------------------------
    def export_hf(self, trainer) -> Path | None:
        from hyperpar.checkpoint.hf_export import export_live

        out = self.run_dir / "hf"
        path = export_live(trainer.model, out, rank=self.rank)
        _barrier()
        if self.rank == 0:
            log.info("exported Hugging Face model to %s", out)
        return path


def preflight(cfg: DictConfig, run_dir: str) -> Path | None:
    """Driver-side checks before any worker starts (one-line errors, no worker logs around them):
    the checkpoint a run would resume from exists, is complete and intact, and fits the model.

    Returns that checkpoint (None for a fresh start). The workers repeat the checks when they load.
    """
    from hyperpar.config import build

    c = cfg.checkpoint
    if c.resume not in RESUME_MODES:
        raise ConfigError(f"checkpoint.resume='{c.resume}' is not one of {', '.join(RESUME_MODES)}")
    ck = Checkpointer(enabled=False, resume=c.resume, load_path=c.load_path, run_dir=run_dir, job_cfg=cfg)
    path = ck._choose()
    if path is None:
        return None
    train_state = d.read_json(path / d.TRAIN_STATE, "trainer state")
    metadata = st.read_metadata(path)
    st.check_files(path, metadata)
    builder = build(cfg.model)
    meta_model = builder.build_meta()
    template = st.model_template(meta_model, metadata)
    st.check_compatible(path, metadata, {"model": template}, train_state.get("model"), _model_tag(cfg) or "")
    return path


def build_checkpointer(**kwargs: Any) -> Checkpointer:
    """``_target_`` of the checkpoint group: the config fields plus the run context
    (``run_dir``, ``job_cfg``, ``rank``, ``world_size``, ``device_type``)."""
    return Checkpointer(**kwargs)


__all__ = ["Checkpointer", "build_checkpointer", "preflight", "RESUME_MODES"]
