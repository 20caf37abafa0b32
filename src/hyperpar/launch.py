"""Start workers (elastic launch), or run in-process; and the worker itself.

worker: device + process group -> mesh -> model (meta) -> parallelize -> materialize/load
        -> optimizer + LR schedule -> data loader -> Trainer.fit
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hyperpar import driver_watch, worker_fork
from hyperpar.errors import HyperparError, TrainingError

log = logging.getLogger("hyperpar")

USER_ERROR_FILE = "user_error.txt"
_jobs_in_process = 0  # per-job store prefix: ranks run the same job sequence, so counters agree


def under_torchrun() -> bool:
    """This process is a rank started by an external torchrun/elastic agent (not by us)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("HYPERPAR_WORKER") != "1"


def env_rank() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from the launcher's environment, else one process."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def _init_process_group(backend: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    global _jobs_in_process
    _jobs_in_process += 1
    if "MASTER_ADDR" not in os.environ:
        # One process and no launcher: an in-memory store, no ports.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    # A restarted group or a second job in the same workers must not read the previous round's peers
    # from the launcher's long-lived store, so every job and attempt gets its own key prefix.
    from datetime import timedelta

    is_master = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                         is_master=is_master, timeout=timedelta(minutes=10))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hyperpar/{run_id}/job{_jobs_in_process}/attempt{attempt}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(minutes=30))


def _threads_for(local_world: int, configured: int) -> int:
    if configured > 0:
        return configured
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def worker_main(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Train one job as one rank. Returns a small summary (rank 0's losses)."""
    import torch
    import torch.distributed as dist
    from hyperpar.checkpoint.manager import samples_to_read
    from hyperpar.checkpoint.preemption import PreemptionFlag
    from hyperpar.config import build as instantiate
    from hyperpar.config import dtype_of
    from hyperpar.models.layers import cpu_matmul, onednn_gemm
    from hyperpar.models.layers.lm_head import fuse_head_loss

    from hyperpar.data.loader import DistributedBatchLoader
    from hyperpar.data.pad import pad_token_id
    from hyperpar.data.registry import DataContext
    from hyperpar.device import resolve_device, set_deterministic
    from hyperpar.host_allocator import tune_host_allocator
    from hyperpar import denormals
    from hyperpar.distributed.context_parallel import SequenceShard
    from hyperpar.distributed import shm_collectives, shm_params
    from hyperpar.distributed.fsdp import prime_unsharded_params
    from hyperpar.distributed.materialize import materialize
    from hyperpar.distributed.tensor_parallel import use_loss_parallel
    from hyperpar.train.objective import Objective
    from hyperpar.train.pipeline_step import PipelineStep
    from hyperpar.train.profiler import StepProfiler
    from hyperpar.train.metrics import MetricsWriter, setup_rank_logging

    rank, world, local_rank, local_world = env_rank()
    setup_rank_logging(run_dir, rank, console=rank == 0)
    torch.set_num_threads(_threads_for(local_world, cfg.launch.threads_per_rank))
    # Process-wide settings this job changes, handed back as they were when it ends, failed or not (an
    # in-process caller, a multirun's next job, the next test).
    denormals_before = denormals.flushing()
    matmul_before = gemm_before = preemption = None
    pg_ours = False
    # before the first kernel on the device
    fill_before = set_deterministic(bool(cfg.train.deterministic), bool(cfg.train.fill_uninitialized_memory))
    try:
        dev = resolve_device(cfg.device)
        matmul_before = cpu_matmul.set_policy(cfg.train.mixed_precision.cpu_matmul)
        gemm_before = onednn_gemm.set_policy(cfg.launch.cpu_gemm)
        if dev.type == "cpu":  # on CPU the step's activations and gradients are host memory
            tune_host_allocator(cfg.launch.host_allocator)
            cpu_facts = []  # one console line for the CPU's run-time choices (a bad-input run stays short)
            if cfg.launch.flush_denormals and denormals.flush_denormals(True, quiet=True) and denormals.flushing():
                cpu_facts.append("subnormal floats flush to zero (launch.flush_denormals)")
            cpu_facts += [fact for fact in (cpu_matmul.describe(dtype_of(cfg.train.mixed_precision.param_dtype)),
                                            onednn_gemm.describe(int(cfg.parallel.tp) > 1)) if fact]
            if cpu_facts:
                log.info("CPU: %s", "; ".join(cpu_facts))
        dev.set_device(local_rank)
        device = dev.device(local_rank)
        _init_process_group(dev.backend, rank, world)
        pg_ours = True
        preemption = PreemptionFlag().install()  # SIGTERM: finish the step, save, exit 0
        pdims = instantiate(cfg.parallel)
        if pdims.world_size != world:
            raise HyperparError(f"parallel.world_size={pdims.world_size} but the launcher started {world} processes",
                                hint="pick a parallel layout for this many processes")
        pdims.check_supported()
        pdims.build_mesh(dev.type)
        builder = instantiate(cfg.model)
        log.info("layout %s, model %s, device %s", pdims.describe(), builder.describe(), device)
        dev.seed_all(cfg.train.seed)
        model = builder.build_meta()
        # The model parts: the whole model, or with pipeline parallelism one per stage this rank runs.
        pipeline = PipelineStep(builder, pdims, cfg, device) if pdims.pp > 1 else None
        parts = pipeline.parts if pipeline is not None else [builder.spec.parallelize(model, pdims, cfg)]
        model = parts[0]
        if cfg.train.fused_head_loss and pipeline is None:  # a stage's head hands the schedule logits
            fuse_head_loss(model)
        load_report: dict = {}
        if dev.type == "cpu":
            if n_units := shm_collectives.install(parts, shared=cfg.launch.cpu_collectives == "shm"):
                log.info("cpu_collectives=shm: %d FSDP units all-gather and reduce-scatter through shared "
                         "memory (%s)", n_units, shm_collectives.SHM_DIR)
        for part in parts:
            materialize(part, device, seed=cfg.train.seed, source=builder.weight_source(), report=load_report)
        if dev.type == "cpu" and cfg.launch.cpu_collectives == "shm":
            shm_params.home(parts)  # before the optimizer (the parameters' storage moves) and any all-gather
        for part in parts:
            prime_unsharded_params(part)
        if builder.load_weights:
            mb = 2**20
            log.info("loaded %s: this rank holds %.1f MB of parameters, read %.1f MB (largest read %.1f MB)",
                     builder.hf_path, load_report["local_param_bytes"] / mb, load_report["read_bytes"] / mb,
                     load_report["max_read_bytes"] / mb)
        for part in parts:
            part.train()
        optimizer, scheduler = instantiate(cfg.optim, _partial_=True)(
            model=pipeline.optim_model if pipeline is not None else model, total_steps=cfg.train.steps)
        shm_params.guard_optimizer(optimizer)
        t = cfg.train
        # Restarted workers (elastic restart) always resume from the newest complete checkpoint.
        checkpointer = instantiate(cfg.checkpoint, _partial_=True)(
            run_dir=run_dir, job_cfg=cfg, rank=rank, world_size=world, device_type=dev.type,
            tied_embeddings=bool(getattr(builder.args, "tie_word_embeddings", False)))
        resume_path = checkpointer.choose_resume()
        ctx = DataContext(seq_len=t.seq_len, seed=t.seed, num_samples=samples_to_read(t, resume_path),
                          vocab_size=builder.args.vocab_size if hasattr(builder.args, "vocab_size") else builder.args.text.vocab_size,
                          model_args=builder.args, default_type=builder.auto_data, run_dir=run_dir)
        dataset = instantiate(cfg.data, _partial_=True, _convert_="all")(context=ctx)
        loader = DistributedBatchLoader.for_layout(dataset, pdims, t, pad_id=pad_token_id(builder.args))
        seq_flops = model.flops_per_token(t.seq_len)
        trainer = instantiate(cfg.trainer, _partial_=True)(
            model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, parallel_dims=pdims,
            device_info=dev, device=device, run_dir=run_dir, steps=t.steps, max_grad_norm=t.max_grad_norm,
            flops_per_token=seq_flops, peak_flops=dev.peak_flops(torch.float32 if t.mixed_precision.param_dtype == "float32" else torch.bfloat16, cfg.metrics.peak_tflops),
            rank=rank, metrics=None, checkpointer=checkpointer, stop_after_steps=t.stop_after_steps, preemption=preemption,
            mtp_loss_weight=cfg.model.mtp_loss_weight, pipeline=pipeline,
            objective=Objective(mtp_weight=cfg.model.mtp_loss_weight, loss_parallel=use_loss_parallel(pdims, cfg.train),
                                cp=SequenceShard.of(pdims), compiled=t.compile),
            profiler=StepProfiler.from_config(cfg.profile, run_dir, rank, dev.type),
            route_counts=cfg.metrics.route_counts,
        )
        checkpointer.resume(trainer, resume_path)
        shm_params.parameters_written()  # a resumed checkpoint wrote every rank's rows
        # metrics.jsonl is appended to: a resumed run continues its file (readers keep the last record per step).
        metrics = MetricsWriter(run_dir, rank=rank, total_steps=t.steps, start_step=trainer.step,
                                progress_bar=cfg.metrics.progress_bar, tensorboard=cfg.metrics.tensorboard, log_every=t.log_every)
        trainer.metrics = metrics
        try:
            result = trainer.fit()
        finally:
            metrics.close()
        if world > 1:
            dist.barrier()
        # Which signal stopped the loop: SIGTERM = preempted, Ctrl-C = stopped (the driver's status).
        return {"rank": rank, **result, **({"stop_reason": preemption.reason} if preemption.reason else {})}
    except HyperparError as e:
        _record_user_error(run_dir, e.one_line(), overwrite=rank == 0)
        raise
    finally:
        if preemption is not None:
            preemption.restore()
        torch.utils.deterministic.fill_uninitialized_memory = fill_before
        if denormals.flushing() != denormals_before:
            denormals.flush_denormals(denormals_before)
        if matmul_before is not None:
            cpu_matmul.set_policy(matmul_before)
        if gemm_before is not None:
            onednn_gemm.set_policy(gemm_before)
        shm_collectives.release()
        shm_params.release()
        if pg_ours and dist.is_initialized():
            dist.destroy_process_group()


def _record_user_error(run_dir: str, line: str, *, overwrite: bool) -> None:
    """Leave a worker's user error for the driver, which reports it once (USER_ERROR_FILE). Rank 0's
    error wins (``overwrite``); another rank's is kept only if no rank wrote one first."""
    path = Path(run_dir) / USER_ERROR_FILE
    if not overwrite and path.exists():
        return
    try:
        path.write_text(line + "\n")
    except OSError:
        print(line, file=sys.stderr)  # the run dir is gone: say it here


def run_worker(cfg_path: str, run_dir: str, envs: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """Entry of a worker process started by :func:`launch_workers` (module-level: pickled by reference).

    ``envs``: (the driver's environment at launch, the fork server's) when forked from the server."""
    if envs is not None:
        worker_fork.adopt_driver_env(*envs)
    os.environ["HYPERPAR_WORKER"] = "1"
    from hyperpar.checkpoint.preemption import restart_attempt

    if restart_attempt() > 0 and (Path(run_dir) / USER_ERROR_FILE).exists():
        # The attempt before stopped on a user error (bad data or config, a non-finite loss): a restart
        # resumes the same checkpoint with the same data and meets it again, after redoing every step
        # since. Restarts are for crashes; this attempt exits at once and the driver reports that error.
        sys.exit(2)
    driver_watch.watch_driver_from_env()  # a driver that dies (kill -9, OOM) stops its workers
    cfg = OmegaConf.load(cfg_path)
    try:
        result = worker_main(cfg, run_dir)
    except HyperparError as e:
        # The driver reports the error once (it reads user_error.txt); every rank printing it too made
        # one line N + 1. The rank's log keeps it. worker_main writes the file for errors of its job;
        # one raised before (the device, the process group) is written here.
        _log_to_rank_file(e.one_line())
        _record_user_error(run_dir, e.one_line(), overwrite=False)
        sys.exit(2)
    except Exception as e:
        import traceback

        # A bug's traceback goes to the rank's log (the driver's one line points there); the launcher
        # prints it once on the console (see _WorkerExitFilter).
        _log_to_rank_file(traceback.format_exc().rstrip())
        if _peer_lost(e):
            # A rank that died (killed, out of memory) breaks its peers' next collective at once. The
            # launcher reports the first failed rank it finds: this one waits a moment before it
            # exits, so that is the rank that died, not a survivor's connection error.
            import time

            time.sleep(max(1.0, 3 * float(cfg.launch.monitor_interval)))
        raise
    if result.get("stop_reason") in ("preempted", "stopped") or driver_watch.gone():
        # An agent that forwarded SIGTERM (or SIGINT: Ctrl-C) is shutting down and no longer tells
        # workers that it has read their result: it would SIGKILL them after its shutdown timeout (and
        # a dead driver's agent never reads it). The result is queued (the pipe keeps it) by the time
        # this fires, so exiting 0 is safe whether or not the agent reads it.
        import threading

        timer = threading.Timer(2.0, os._exit, args=(0,))
        timer.daemon = True
        timer.start()
    return result


def _worker_failure(rank: int, failure: Any, run_dir: str, max_restarts: int) -> HyperparError:
    """One line for a worker that died or crashed (the launcher's own report is a traceback wall)."""
    from hyperpar.errors import WorkerError

    log_file = Path(run_dir) / "logs" / f"rank_{rank}.log"
    code = failure.exitcode
    after = f" after {max_restarts} restart(s)" if max_restarts > 0 else ""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (killed from outside: out of memory, or a scheduler)" if -code == signal.SIGKILL else ""
        message = f"worker rank {rank} died of {name}{why}{after}; its log: {log_file}"
    else:
        message = f"worker rank {rank} exited with code {code}{after}; its traceback is above and in {log_file}"
    hint = None if max_restarts > 0 else "launch.max_restarts=N with checkpoint=default restarts the workers from the last checkpoint"
    return WorkerError(message, hint=hint)


def _log_to_rank_file(line: str) -> None:
    """Write ``line`` to this rank's ``logs/rank_<r>.log`` only (not the console)."""
    for h in logging.getLogger("hyperpar").handlers:
        if isinstance(h, logging.FileHandler):
            h.emit(logging.LogRecord("hyperpar", logging.ERROR, __file__, 0, line, None, None))


class _WorkerExitFilter(logging.Filter):
    """The elastic launcher logs a failed worker with the traceback of its own polling code (torch's
    spawn internals, a dozen lines). Drop that: a worker that exited 2 stopped on a user error that
    the driver reports itself (dropped); a worker killed by a signal keeps one line with the
    exception's words (``process 1 terminated with signal SIGKILL``); a worker that raised keeps its
    own traceback, which the exception carries (the driver's one line says it is above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or type(exc).__name__ not in ("ProcessExitedException", "ProcessRaisedException"):
            return True
        if getattr(exc, "exit_code", None) == 2:
            return False
        words = str(exc).strip() or type(exc).__name__
        if type(exc).__name__ == "ProcessExitedException":
            words = words.splitlines()[0]
        record.msg = f"{record.getMessage()}: {words}"
        record.args = None
        record.exc_info = record.exc_text = None
        return True


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _peer_lost(e: BaseException) -> bool:
    """The error is a collective's connection to another rank breaking (gloo's words for it)."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_LOST)


def _user_error(line: str) -> HyperparError:
    """The worker's one-line user error, re-raised in the driver with its kind (config, checkpoint, ...)."""
    kind, _, message = line.strip().partition(" error: ")
    classes = {c.kind: c for c in HyperparError.__subclasses__()}
    if kind not in classes or not message:
        return TrainingError(line.strip().split(" error: ", 1)[-1])
    message, _, hint = message.partition(" (hint: ")
    return classes[kind](message, hint=hint[:-1] if hint.endswith(")") else None)


def set_worker_threads(cfg: DictConfig) -> None:
    """Each rank gets its share of the cores; OMP_NUM_THREADS otherwise defaults to all of them per rank."""
    n = int(cfg.parallel.world_size)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_for(n, int(cfg.launch.threads_per_rank))))


def start_method(cfg: DictConfig) -> str:
    """``launch.start_method``, or spawn where this platform has no fork server."""
    return "forkserver" if cfg.launch.start_method == "forkserver" and worker_fork.available() else "spawn"


def start_workers_early(cfg: DictConfig) -> None:
    """The driver will launch workers: start the fork server now, so its imports run while the
    driver plans (the server then has the driver's environment, OMP_NUM_THREADS included)."""
    if int(cfg.parallel.world_size) > 1 and not under_torchrun() and not cfg.dry_run and start_method(cfg) == "forkserver":
        set_worker_threads(cfg)
        worker_fork.start()


def launch_workers(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Start world_size local workers with PyTorch's elastic launcher (torchrun semantics)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg_path = str(Path(run_dir) / "config.yaml")
    n = int(cfg.parallel.world_size)
    set_worker_threads(cfg)
    method = start_method(cfg)
    os.environ[driver_watch.ENV] = str(os.getpid())  # the workers watch it (see driver_watch)
    envs = (dict(os.environ), worker_fork.start()) if method == "forkserver" else None
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=int(cfg.launch.max_restarts),
        monitor_interval=float(cfg.launch.monitor_interval), start_method=method,
        logs_specs=DefaultLogsSpecs(log_dir=str(Path(run_dir) / "workers"), redirects=Std.NONE, tee=Std.NONE),
    )
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    exit_filter = _WorkerExitFilter()
    elastic_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    elastic_log.addFilter(exit_filter)
    try:
        results = elastic_launch(lc, run_worker)(cfg_path, run_dir, envs)
    except SignalException as e:
        if e.sigval not in (signal.SIGTERM, signal.SIGINT):
            raise
        # Preemption or Ctrl-C: the agent forwarded the signal; the workers finished their step, saved
        # and exited. The driver prints the status and how to resume.
        reason = "preempted" if e.sigval == signal.SIGTERM else "stopped"
        log.warning("%s (%s): the workers saved a checkpoint when checkpointing is on", reason, signal.Signals(e.sigval).name)
        return {"preempted": True, "losses": [], "final_loss": None, "stop_reason": reason}
    except ChildFailedError as e:
        user = Path(run_dir) / USER_ERROR_FILE
        if user.exists():
            raise _user_error(user.read_text()) from None
        rank, failure = e.get_first_failure()
        raise _worker_failure(rank, failure, run_dir, int(cfg.launch.max_restarts)) from None
    finally:
        elastic_log.removeFilter(exit_filter)
        for s, h in saved.items():
            signal.signal(s, h)
    return results[0]


def _max_restarts_note(cfg: DictConfig) -> str | None:
    """Restarts are the elastic launcher's job: say so when ours is not the one starting the workers."""
    n = int(cfg.launch.max_restarts)
    if n <= 0 or (under_torchrun() and int(os.environ.get("RANK", 0)) != 0):
        return None
    if under_torchrun():
        return f"launch.max_restarts={n} has no effect under an external torchrun (use torchrun --max-restarts={n})"
    if int(cfg.parallel.world_size) == 1:
        return f"launch.max_restarts={n} has no effect with one process (restarts need parallel.world_size > 1)"
    return None


_started: set[str] = set()  # run dirs this process began writing a job into (so it may record its failure)


def job_started(run_dir: str) -> bool:
    return str(Path(run_dir).resolve()) in _started


def run_job(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Run the job from the driver: in-process for one rank or under torchrun, else start workers."""
    from hyperpar import run_lock

    if under_torchrun() and int(os.environ.get("RANK", 0)) != 0:
        run_lock.ensure_run_dir(run_dir)
        return _run_job_locked(cfg, run_dir)
    with run_lock.hold(run_dir):  # one run per run dir: released on exit, and by the kernel if we die
        return _run_job_locked(cfg, run_dir)


def _run_job_locked(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    from hyperpar.checkpoint.manager import preflight

    preflight(cfg, run_dir)  # a bad load_path / damaged or foreign checkpoint fails here, before any worker
    _started.add(str(Path(run_dir).resolve()))
    restarts_note = _max_restarts_note(cfg)
    if restarts_note:
        print(f"[hyperpar] {restarts_note}", file=sys.stderr)
    if under_torchrun():
        if int(os.environ.get("RANK", 0)) == 0:  # the run's outputs are rank 0's, as under our launcher
            OmegaConf.save(cfg, Path(run_dir) / "config.yaml", resolve=True)
        return worker_main(cfg, run_dir)
    # A resumed run reuses its run dir: an error file of an earlier invocation must not be reported as this one's.
    (Path(run_dir) / USER_ERROR_FILE).unlink(missing_ok=True)
    OmegaConf.save(cfg, Path(run_dir) / "config.yaml", resolve=True)
    if int(cfg.parallel.world_size) == 1:
        return worker_main(cfg, run_dir)
    return launch_workers(cfg, run_dir)


STATUSES = ("completed", "stopped", "preempted", "failed")


def write_result(run_dir: str, cfg: DictConfig, *, status: str, error: str | None, job_name: str, overrides: list[str],
                 step: int | None = None) -> None:
    """``status``: completed | stopped (Ctrl-C, train.stop_after_steps) | preempted (SIGTERM) | failed."""
    if status not in STATUSES:
        raise ValueError(f"unknown run status {status!r}")
    record = {
        "status": status, "error": error, "job_name": job_name, "overrides": overrides, "step": step,
        "parallel": cfg.parallel.name, "world_size": int(cfg.parallel.world_size),
        "param_dtype": cfg.train.mixed_precision.param_dtype, "steps": int(cfg.train.steps), "seed": int(cfg.train.seed),
        "model": cfg.model.name,
    }
    (Path(run_dir) / "result.json").write_text(json.dumps(record, indent=2) + "\n")
