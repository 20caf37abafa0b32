"""Checkpointer: periodic atomic saves, resume (explicit, automatic, after an elastic restart), HF export.

Built from the ``checkpoint`` config group by :func:`build_checkpointer`; the Trainer calls
``after_step`` after every optimizer step and ``at_end`` when its loop ends. The worker calls
``resume`` once before training.

Resume rules, first match wins:
  1. a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, whatever ``resume`` says): the newest
     verified checkpoint of this run's ``checkpoints/`` directory (its own progress);
  2. ``load_path``: that checkpoint (or the newest verified one under a run / checkpoints directory);
     an explicit path always wins over ``resume: auto``;
  3. ``resume: auto``: the newest verified checkpoint of this run's ``checkpoints/``; damaged or
     incomplete newer ones are skipped, each named with the reason;
  4. otherwise a fresh start.
``enabled`` only controls saving. "Verified": every file matches the size and checksum recorded
when its save completed (``integrity``), and the ``.metadata`` index reads with the safe unpickler.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from hyperpar.checkpoint import directory as d
from hyperpar.checkpoint import integrity
from hyperpar.checkpoint import state as st
from hyperpar.checkpoint.preemption import fault_hook_disk_full, fault_hook_in_save, restart_attempt
from hyperpar.errors import CheckpointError, ConfigError, HyperparError, TrainingError
from hyperpar.train import lr as lr_schedule

log = logging.getLogger("hyperpar")

RESUME_MODES = ("auto", "never")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank (all-gather of picklable objects)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


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
        tied_embeddings: bool | None = None,
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
        # tied input/output embeddings save the same tensors as untied ones (the alias's value, no state
        # of its own), so a resume across a change of tying would pass every shape check: recorded
        self.tied_embeddings = tied_embeddings
        self.rank = rank
        self.world_size = world_size
        self.device_type = device_type
        self.restart_count = restart_attempt() if restart_count is None else restart_count
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self.trusted: set[Path] = set()  # checkpoints this run wrote or verified: retention keeps these
        self._pending: tuple[Any, int, Path, int] | None = None  # async: (future, step, tmp dir, bytes)
        self._async_group = None
        if enabled and async_save and dist.is_available() and dist.is_initialized():
            # Background saves run their collectives on their own gloo group so they never interleave
            # with the training collectives of the default group.
            self._async_group = dist.new_group(backend="gloo")

    # ---- resume -------------------------------------------------------------------------------
    def _choose(self) -> Path | None:
        restarted = self.restart_count > 0
        if restarted:
            own = newest_intact(self.root)
            if own is not None:
                return own
        if self.load_path:
            return resolve_intact(self.load_path)
        if self.resume_mode == "auto":
            return newest_intact(self.root)
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

    def resume(self, trainer, path: Path | None) -> int | None:
        """Load checkpoint ``path`` (what ``choose_resume`` returned; None: a fresh start) into
        ``trainer`` (model, optimizer, schedule, loader, counters, RNG)."""
        if path is None:
            if self.restart_count > 0:
                log.warning("restart %d found no complete checkpoint: training starts over", self.restart_count)
            return None
        self.load(path, trainer)
        return trainer.step

    def load(self, path: Path, trainer) -> None:
        path = Path(path)
        check_intact(path)  # remembered in this process: a no-op after choose_resume verified it
        train_state = d.read_json(path / d.TRAIN_STATE, "trainer state")
        metadata = st.read_metadata(path)
        st.check_files(path, metadata)
        tensors, optim_other = st.split_state(trainer.model_parts, trainer.optimizer)
        untrained = st.untrained_params(metadata, tensors)
        stored = st.without_state(tensors, untrained)
        st.check_compatible(path, metadata, stored, train_state.get("model"), _model_tag(self.job_cfg) or "",
                            elsewhere=self._keys_of_other_stages(trainer, stored))
        saved_tied = train_state.get("tied_embeddings")
        if saved_tied is not None and self.tied_embeddings is not None and saved_tied != self.tied_embeddings:
            # what the shape checks cannot see: both forms save the same tensors
            how = ("ties its input and output embeddings (lm_head is embed_tokens)", "unties them")
            raise CheckpointError(
                f"checkpoint '{path}' was saved by a model that {how[0] if saved_tied else how[1]}, this model "
                f"{how[1] if saved_tied else how[0]}",
                hint=f"resume with tie_word_embeddings={str(saved_tied).lower()} (the checkpoint's config.yaml is next to it)")
        st.load_tensors(path, stored)
        st.apply_model_optim(trainer.model_parts, trainer.optimizer, tensors, optim_other,
                             train_state.get("optim_param_groups", {}), untrained)
        if untrained:
            log.info("%d parameters had no gradient before step %s (%s): no optimizer state saved; AdamW starts "
                     "theirs at their first gradient", len(untrained), train_state.get("step"), st.short_list(untrained))
        try:
            trainer.scheduler.load_state_dict(train_state["scheduler"])
            lr_schedule.resync(trainer.scheduler)
            self._say_what_the_checkpoint_keeps(trainer.optimizer)
            self._say_what_the_data_changes(path)
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
            self.trusted.add(path)
        self.resumed_from = path
        log.info("resumed from %s at step %d (saved by layout %s, %s ranks)", path, trainer.step,
                 train_state.get("layout"), train_state.get("world_size"))

    @staticmethod
    def _keys_of_other_stages(trainer, stored: dict[str, dict[str, torch.Tensor]]) -> set[str]:
        """Under pipeline parallelism each rank loads its stages' keys: what the other ranks load is
        not "unexpected" in the checkpoint (one all-gather of the key lists)."""
        if getattr(trainer, "pipeline", None) is None or not _dist():
            return set()
        own = sorted(st.flat_keys(stored))
        return {k for keys in _gather(own) for k in keys} - set(own)

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
            "tied_embeddings": self.tied_embeddings,
        }

    def save(self, trainer) -> Path:
        self.wait()
        step = trainer.step
        self._refuse_non_finite(trainer, step)
        tmp = self.root / f"{d.step_name(step)}.tmp"
        tensors, optim_other = st.split_state(trainer.model_parts, trainer.optimizer)
        if getattr(trainer, "pipeline", None) is not None and _dist():
            # rank 0 writes the param-group options (LR, decay) for every stage's parameters
            optim_other = {k: v for other in _gather(optim_other) for k, v in other.items()}
        with fault_hook_disk_full(step):
            return self._save(trainer, step, tmp, tensors, optim_other)

    def _say_what_the_checkpoint_keeps(self, optimizer) -> None:
        """The optimizer's options come from the checkpoint (see checkpointing.md); a config that asks for
        others is told so in one line instead of being ignored silently."""
        if self.job_cfg is None or "optim" not in self.job_cfg:
            return
        group, want = optimizer.param_groups[0], self.job_cfg.optim
        betas = group.get("betas") or (None, None)
        saved_options = (("lr", group.get("initial_lr", group["lr"])), ("weight_decay", group.get("weight_decay")),
                         ("beta1", betas[0]), ("beta2", betas[1]), ("eps", group.get("eps")))
        kept = [f"optim.{key}={want[key]} (the checkpoint's {saved:g})" for key, saved in saved_options
                if key in want and saved is not None and float(want[key]) != float(saved)]
        if kept:
            log.warning("resumed with the checkpoint's optimizer options; not applied: %s", ", ".join(kept))

    def _say_what_the_data_changes(self, path: Path) -> None:
        """The data stream continues exactly only with the saving run's data, sequence length and seed;
        a resume that changes them is allowed (a new data mix, a longer context), but said in one line."""
        if self.job_cfg is None or self.rank != 0 or not (path / d.CONFIG).is_file():
            return
        def flat(tree: Any, prefix: str) -> dict[str, Any]:
            if not isinstance(tree, dict):
                return {prefix: tree}
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}.{key}").items()}

        def stream(cfg: DictConfig) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key in ("data", "train.seq_len", "train.seed"):
                value = OmegaConf.select(cfg, key, default=None)
                out.update(flat(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value, key))
            return out

        try:
            was, got = stream(OmegaConf.load(path / d.CONFIG)), stream(self.job_cfg)
        except Exception:  # an unreadable config.yaml is no reason to stop a resume
            return
        changed = [f"{k}={got.get(k)} (was {was.get(k)})" for k in sorted(set(was) | set(got))
                   if was.get(k) != got.get(k) and not k.endswith("cache_dir")]
        if changed:
            log.warning("resumed with other data than the saving run (its batches from here on differ from an "
                        "uninterrupted run's): %s%s", ", ".join(changed[:4]), f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")

    def _refuse_non_finite(self, trainer, step: int) -> None:
        """The trainer checks the loss and gradient norm before each optimizer step, but the step itself can
        overflow the weights (an lr spike: finite gradients, inf weights). Such a checkpoint used to be
        saved, verified and resumed, failing again at once; now the save is refused and the previous
        checkpoint stays the resume point. One isfinite pass over the local shards, one gather."""
        from hyperpar.models.param_names import canonical_name

        named = [(name, p.to_local() if hasattr(p, "to_local") else p)
                 for part in trainer.model_parts for name, p in part.named_parameters()]
        named = [(name, local) for name, local in named if local.numel()]
        bad = []
        if named:
            # one flag per tensor stacked into one vector: one host sync per save on an accelerator
            finite = torch.stack([torch.isfinite(local.detach()).all() for _, local in named]).tolist()
            bad = [canonical_name(name) for (name, _), ok in zip(named, finite) if not ok]
        names = sorted({n for part in _gather(bad) for n in part}) if _dist() else sorted(set(bad))
        if not names:
            return
        previous = d.newest_complete(self.root)
        raise TrainingError(
            f"parameters became non-finite in the optimizer step of step {step} ({len(names)} tensors, e.g. "
            f"{', '.join(names[:3])}): checkpoint {d.step_name(step)} not saved",
            hint=(f"{previous.name} stays the resume point; " if previous else "")
            + "lower optim.lr, enable clipping (train.max_grad_norm) or use float32")

    def _save(self, trainer, step: int, tmp: Path, tensors: dict[str, Any], optim_other: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp

        try:
            if self.rank == 0:
                d.prepare_tmp(self.root, step)
            _barrier()
            if self.rank == 0:
                d.write_json(tmp / d.TRAIN_STATE, self._train_state(trainer, optim_other))
                if self.job_cfg is not None:
                    OmegaConf.save(self.job_cfg, tmp / d.CONFIG, resolve=True)
            d.write_json(tmp / d.RNG_DIR / f"rank_{self.rank:05d}.json", st.rng_state(self.device_type))
            self.last_saved_step = step
            if self.async_save:
                fut = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._async_group)
                self._pending = (fut, step, tmp, _state_bytes(tensors))
                log.info("saving checkpoint step %d in the background", step)
                return tmp
            dcp.save(tensors, checkpoint_id=str(tmp))
        except (Exception, DCPException) as e:  # noqa: BLE001 - DCP wraps a write error per rank (a BaseException)
            self._failed_save(e, step, tmp, _state_bytes(tensors))
            raise
        return self._publish(step, tmp)

    def _failed_save(self, e: BaseException, step: int, tmp: Path, need: int) -> None:
        """A full disk becomes one CheckpointError and the half-written ``.tmp`` goes, so the previous
        checkpoint stays the resume point. "Full": an ENOSPC / EDQUOT anywhere in DCP's wrapped errors,
        or less free space than the checkpoint needs (torch.save reports a failed write of its zip
        stream as "unexpected pos", dropping the OSError)."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = -1
        full = disk_full_error(e)
        if full is None and not 0 <= free < need:
            return
        self.last_saved_step = None
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = d.newest_complete(self.root)
        where = (full.filename if full is not None else None) or tmp
        inner = next((v[0] for v in (getattr(e, "failures", None) or {}).values() if isinstance(v, tuple) and v), e)
        why = (full.strerror if full is not None else None) or f"{type(inner).__name__}: {' '.join(str(inner).split())[:100]}"
        raise CheckpointError(
            f"disk full: saving checkpoint {d.step_name(step)} failed writing '{where}' ({why}); "
            f"it needs about {_mb(need)} and {_mb(free) if free >= 0 else 'an unknown amount'} is free",
            hint=f"free space under {self.root}; " + (f"{previous.name} stays the resume point" if previous else
                                                        "no earlier checkpoint exists")) from None

    def _publish(self, step: int, tmp: Path) -> Path:
        fault_hook_in_save(step)
        # Each rank hashes what it wrote; the gather doubles as the barrier "every rank's files are written".
        own = integrity.checksum_files(tmp, integrity.rank_files(tmp, self.rank))
        parts = _gather(own) if _dist() else [own]
        final = self.root / d.step_name(step)
        if self.rank == 0:
            merged = {k: v for part in parts for k, v in (part or {}).items()}
            files = integrity.complete_manifest(tmp, merged, skip=(d.MARKER,))
            marker = {"world_size": self.world_size, "model": _model_tag(self.job_cfg),
                      "checksum": integrity.ALGORITHM, "files": files}
            final = d.publish(tmp, step, marker)
            integrity.mark_verified(final, files)
            self.trusted.add(final)
            removed = d.prune(self.root, self.keep_last, trusted=self.trusted)
            self.trusted -= set(removed)
            log.info("saved checkpoint %s%s", final,
                     f" (removed {', '.join(p.name for p in removed)})" if removed else "")
        _barrier()  # nobody starts the next save (or exits) before it is visible
        return final

    def wait(self) -> None:
        """Finish a background save: wait for its writes on every rank, then publish it."""
        if self._pending is None:
            return
        fut, step, tmp, need = self._pending
        self._pending = None
        result = getattr(fut, "upload_completion", fut)
        try:
            result.result()
        except (Exception, DCPException) as e:  # noqa: BLE001 - see save()
            self._failed_save(e, step, tmp, need)
            raise
        self._publish(step, tmp)

    # ---- export -------------------------------------------------------------------------------
    def export_hf(self, trainer) -> Path | None:
        from hyperpar.checkpoint.hf_export import export_live

        out = self.run_dir / "hf"
        path = export_live(trainer.model_parts, out, rank=self.rank, pipeline=trainer.pipeline)
        _barrier()
        if self.rank == 0:
            log.info("exported Hugging Face model to %s", out)
        return path


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """The driver's preflight and an in-process worker choose the same checkpoint: say why once."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def newest_intact(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` that passes :func:`check_intact`; each newer one
    that does not is skipped with a warning saying why. None when ``root`` has no complete one."""
    stale = d.incomplete(root)
    if stale:
        log.warning("ignoring incomplete checkpoint(s) (interrupted saves): %s", ", ".join(p.name for p in stale))
    skipped: list[tuple[Path, CheckpointError]] = []
    for _, p in reversed(d.list_complete(root)):
        try:
            check_intact(p)
        except CheckpointError as e:
            skipped.append((p, e))
            _warn_once(f"skipping checkpoint {p.name}: {e}")
            continue
        if skipped:
            _warn_once(f"using {p.name}, the newest intact checkpoint (skipped {', '.join(q.name for q, _ in skipped)})")
        return p
    if skipped:
        first, err = skipped[0]
        raise CheckpointError(f"no intact checkpoint in '{root}' ({len(skipped)} damaged; newest, {first.name}: {err})",
                              hint="restore a good copy, or resume=never to start over")
    return None


def resolve_intact(path: str | Path, what: str = "checkpoint.load_path") -> Path:
    """An explicit checkpoint (or the newest intact one under a run / checkpoints dir), verified."""
    p = d.resolve_load_path(path, what=what, pick=newest_intact)
    check_intact(p)
    return p


def check_intact(path: Path) -> None:
    """The checkpoint's files are those its save recorded (checksums), its index reads without running
    code and points inside its data files, and its trainer state is readable. One CheckpointError if not."""
    path = Path(path)
    if not d.verify_checkpoint(path):
        log.info("checkpoint %s was saved without checksums: only its structure is checked", path)
    metadata = st.read_metadata(path)
    st.check_files(path, metadata)
    d.read_json(path / d.TRAIN_STATE, "trainer state")


def disk_full_error(e: BaseException | None, _seen: set[int] | None = None) -> OSError | None:
    """The ENOSPC / EDQUOT OSError inside ``e`` (causes, contexts, DCP's per-rank failures), if any."""
    seen = _seen if _seen is not None else set()
    if e is None or id(e) in seen:
        return None
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return e
    inner = [e.__cause__, e.__context__, getattr(e, "exc", None)]
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: rank -> (exception, traceback)
        for v in failures.values():
            inner += list(v) if isinstance(v, tuple) else [v]
    for x in inner:
        if isinstance(x, BaseException) and (found := disk_full_error(x, seen)) is not None:
            return found
    return None


def _state_bytes(tensors: dict[str, dict[str, torch.Tensor]]) -> int:
    """Bytes of the tensors a save writes (DTensors count their global size: every rank's shard)."""
    return sum(t.numel() * t.element_size() for sub in tensors.values() for t in sub.values() if isinstance(t, torch.Tensor))


def _mb(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:.0f} KB"
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


def _data_position(path: Path) -> tuple[dict, int | None, int]:
    """A checkpoint's trainer state, the global batch size it was saved at (None if unrecorded) and
    the samples its loader had consumed."""
    state = d.read_json(Path(path) / d.TRAIN_STATE, "trainer state")
    loader = state.get("loader") or {}
    saved = loader.get("global_batch_size")
    return state, None if saved is None else int(saved), int(loader.get("step", 0)) * int(saved or 0)


def samples_to_read(train_cfg, path: Path | None) -> int:
    """How many samples the run's data source must hold: ``train.steps x train.global_batch_size``, or,
    resuming at step k after ``consumed`` samples at another global batch size, ``consumed`` plus the
    remaining ``(steps - k)`` steps at the new one (a smaller global batch reads past the former)."""
    steps, batch = int(train_cfg.steps), int(train_cfg.global_batch_size)
    if path is None:
        return steps * batch
    state, saved, consumed = _data_position(path)
    if saved is None or saved == batch:  # the same sample stream as the saving run
        return steps * batch
    loader = state.get("loader") or {}
    done = int((state.get("counters") or {}).get("step", loader.get("step", 0)))
    return max(steps * batch, consumed + max(steps - done, 0) * batch)


def check_resumable(path: Path, cfg: DictConfig) -> None:
    """What the loaded trainer state would reject, checked before anything is written: the data
    position only carries over to a global batch size that divides the samples consumed so far."""
    _, saved, consumed = _data_position(path)
    new = int(cfg.train.global_batch_size)
    if saved is None or saved == new:
        return
    if consumed % new:
        raise CheckpointError(f"cannot resume from '{path}' with train.global_batch_size={new}: it consumed {consumed} "
                              f"samples at global batch {saved}, not a multiple of {new}",
                              hint=f"keep train.global_batch_size={saved}, or one that divides {consumed}")


def preflight(cfg: DictConfig, run_dir: str) -> Path | None:
    """Driver-side checks before any worker starts (one-line errors, no worker logs around them):
    the checkpoint a run would resume from exists, is complete and intact, and fits the model.

    Returns that checkpoint (None for a fresh start). The workers repeat the checks when they load.
    """
    from hyperpar.config import build

    c = cfg.checkpoint
    if c.resume not in RESUME_MODES:
        raise ConfigError(f"checkpoint.resume='{c.resume}' is not one of {', '.join(RESUME_MODES)}")
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("RANK", 0)) != 0:
        return None  # under torchrun every rank is a driver: rank 0 checks (and verifies) for all
    ck = Checkpointer(enabled=False, resume=c.resume, load_path=c.load_path, run_dir=run_dir, job_cfg=cfg)
    path = ck._choose()
    if path is None:
        return None
    check_resumable(path, cfg)
    integrity.share_with_workers()
    train_state = d.read_json(path / d.TRAIN_STATE, "trainer state")
    metadata = st.read_metadata(path)
    st.check_files(path, metadata)
    builder = build(cfg.model)
    meta_model = builder.build_meta()
    template = st.model_template(meta_model, metadata)
    st.check_compatible(path, metadata, {"model": template}, train_state.get("model"), _model_tag(cfg) or "")
    _rewind(cfg, run_dir, path)
    return path


def _rewind(cfg: DictConfig, run_dir: str, path: Path) -> None:
    """A run that loads an earlier checkpoint of its own dir (rewinding past a loss spike) leaves the
    later branch: its newer checkpoints and metrics records are moved aside, or a restart, the next
    ``resume=auto`` and the stop message would return to that branch's newest checkpoint."""
    from hyperpar.train.metrics import retire_records_after

    root = d.checkpoints_dir(run_dir)
    if not cfg.checkpoint.load_path or restart_attempt() > 0:
        return
    if not root.is_dir() or path.parent.resolve() != root.resolve():
        return
    moved = d.retire_newer(root, path)
    if moved:
        records = retire_records_after(run_dir, d.step_of(path) or 0)
        print(f"[hyperpar] rewinding to {path.name}: {', '.join(p.name for p in moved)} moved to "
              f"{moved[0].parent} and {records} later metrics records to metrics.abandoned.jsonl", file=sys.stderr)


def build_checkpointer(**kwargs: Any) -> Checkpointer:
    """``_target_`` of the checkpoint group: the config fields plus the run context
    (``run_dir``, ``job_cfg``, ``rank``, ``world_size``, ``device_type``)."""
    return Checkpointer(**kwargs)


__all__ = ["Checkpointer", "build_checkpointer", "preflight", "check_intact", "check_resumable", "RESUME_MODES"]
