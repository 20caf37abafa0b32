"""Hydra main: compose -> validate -> plan -> launch.

torch is imported lazily (inside the task) so ``--help`` and tab completion stay fast.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hyperpar.config import check_values, compose_config, name_layout, register_configs, validate_schema
from hyperpar.errors import ConfigError, HyperparError

CONFIG_PATH = "pkg://hyperpar.conf"


def _run_name() -> str:
    """One run dir for every rank: torchrun's run id, or rank 0's timestamp shared through the store."""
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("HYPERPAR_WORKER") == "1":
        return stamp
    rid = os.environ["TORCHELASTIC_RUN_ID"]
    if rid != "none":
        return f"torchrun-{rid}"
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key = f"hyperpar/run_name/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ.get("RANK", 0)) == 0:
        store.set(key, stamp)
        return stamp
    return store.get(key).decode()


def _register() -> None:
    if not OmegaConf.has_resolver("hp_run_name"):
        OmegaConf.register_new_resolver("hp_run_name", _run_name, use_cache=True)
    register_configs()


_register()


def _error(e: HyperparError) -> None:
    print(e.one_line(), file=sys.stderr)
    sys.exit(getattr(e, "exit_code", 2))


def _job_label(overrides: list[str]) -> str:
    shown = [o for o in overrides if not o.startswith(("hydra.", "+experiment"))]
    return ",".join(shown) or "defaults"


def _last_step(run_dir: str) -> int | None:
    """The last step a failed run did: ``metrics.jsonl``'s last record (rank 0 writes one per step), not
    its largest step (a resumed run that failed early wrote below its file's end)."""
    from hyperpar.train.metrics import parse_record

    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        rec = parse_record(line)  # None for a line cut short by the crash
        if rec is not None:
            return int(rec["step"])
    return None


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> float | None:
    _start_fork_server(cfg)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_task)(cfg)


def _start_fork_server(cfg: DictConfig) -> None:
    """Start the workers' fork server before this process imports torch: the two imports (~3-4 s
    each on 2 cores) then overlap instead of running one after the other. The only start: a config
    the checks refuse starts nothing, and ``_task`` runs the same checks and reports what they raise."""
    from hyperpar.launch import start_workers_early

    try:
        start_workers_early(name_layout(check_values(validate_schema(cfg), warn=False)))
    except Exception:  # noqa: BLE001  (only a head start; _task reports the error)
        pass


def _task(cfg: DictConfig) -> float | None:
    from hyperpar import run_status
    from hyperpar.launch import job_started, run_job, under_torchrun, write_result
    from hyperpar.parity.callback import check_attached
    from hyperpar.plan import make_plan

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    rank0 = int(os.environ.get("RANK", 0)) == 0 or not under_torchrun()
    try:  # outside the job's try: a parity sweep keeps going on job errors, this one must stop it
        check_attached(cfg.parity, hc.callbacks)
        if cfg.get("run_dir") is not None:  # the driver sets it to Hydra's output dir below
            raise ConfigError("run_dir is set by the driver (the run's output dir)",
                              hint="choose it with hydra.run.dir=... (hydra.sweep.dir with -m)")
    except HyperparError as e:
        _error(e)
    try:
        cfg = name_layout(check_values(validate_schema(cfg), warn=False))  # the driver's preflight warned already
        with_dir = OmegaConf.merge(cfg, {"run_dir": run_dir})
        plan = make_plan(with_dir, strict=not cfg.dry_run)
        if cfg.dry_run:
            if rank0:
                print(plan.render())
            if not plan.ok:
                sys.exit(2)
            return None
        result = run_job(with_dir, run_dir)
    except HyperparError as e:
        # Only a job that began in its run dir records its failure: a refused one (run dir locked by
        # another run, a checkpoint it cannot resume) must leave that dir as it was.
        if rank0 and (multirun or job_started(run_dir)):
            write_result(run_dir, cfg, status="failed", error=e.one_line(), job_name=_job_label(overrides), overrides=overrides,
                         step=_last_step(run_dir))
        if multirun and cfg.parity.enabled:
            # Keep the sweep going so the parity report runs and states which job failed.
            print(e.one_line(), file=sys.stderr)
            return None
        _error(e)
    except Exception as e:
        if rank0 and (multirun or job_started(run_dir)):
            write_result(run_dir, cfg, status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0],
                         job_name=_job_label(overrides), overrides=overrides, step=_last_step(run_dir))
        if multirun and cfg.parity.enabled:
            import traceback

            traceback.print_exc()
            return None
        raise
    if rank0:
        write_result(run_dir, cfg, status=run_status.status_of(result), error=None, job_name=_job_label(overrides),
                     overrides=overrides, step=result.get("steps"))
        run_status.report(result, cfg, run_dir, overrides)
    if run_status.exit_code(result) and not multirun:
        sys.exit(run_status.exit_code(result))
    return result.get("final_loss")


# ---- pre-flight: make compose errors one line ---------------------------------------------------
def _split_argv(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, is_special, multirun): special = --cfg/--info/--help etc., where Hydra handles everything."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    special = any(getattr(args, k, None) for k in ("help", "hydra_help", "cfg", "info", "shell_completion", "version", "experimental_rerun"))
    return list(args.overrides), special, bool(getattr(args, "multirun", False))


def _explicit_run_dir(overrides: list[str]) -> str | None:
    """``hydra.run.dir=X`` when given literally (a timestamped default dir is new: nothing to protect)."""
    for o in reversed(overrides):
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+~") == "hydra.run.dir" and value and "${" not in value:
            return value.strip("'\"")
    return None


def _guard_run_dir(cfg: DictConfig, run_dir: str) -> None:
    """Before Hydra writes ``.hydra/`` and its log into an explicit run dir: take the run-dir lock (held
    until this process exits) and, when the dir already holds a run, check the checkpoint it would
    resume, so a refused run leaves that dir untouched."""
    from hyperpar import run_lock

    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("RANK", 0)) != 0:
        return
    p = Path(run_dir)
    existed = (p / "config.yaml").exists() or (p / "checkpoints").exists()
    run_lock.acquire(p)
    if existed and not cfg.dry_run:
        from hyperpar.checkpoint.manager import preflight as checkpoint_preflight

        checkpoint_preflight(OmegaConf.merge(cfg, {"run_dir": str(p)}), str(p))


def _first_of_sweeps(overrides: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for o in parsed:
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()), None)
            if first is None:
                continue
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(o.input_line)
    return out


def preflight(argv: list[str]) -> None:
    """Compose once with Hydra's API so a typo, a wrong type or an unknown option is one line, exit 2."""
    overrides, special, multirun = _split_argv(argv)
    if special:
        return
    try:
        try:
            first = _first_of_sweeps(overrides)
        except Exception as e:  # noqa: BLE001 - Hydra's grammar errors
            raise ConfigError(" ".join(str(e).split()), hint="overrides look like group=option or key=value") from None
        job_overrides = [o for o in first if not o.startswith(("hydra.", "hydra/"))]
        try:
            cfg = compose_config(job_overrides)
        except Exception as e:  # noqa: BLE001 - every compose failure is a config mistake of the user
            from hyperpar.config_hints import unknown_key_hint

            message = _compose_message(e)
            raise ConfigError(message, hint=unknown_key_hint(message, job_overrides)) from None
        cfg = check_values(validate_schema(cfg))
        run_dir = None if multirun else _explicit_run_dir(overrides)
        if run_dir is not None:
            _guard_run_dir(cfg, run_dir)
    except HyperparError as e:
        _error(e)


def _compose_message(e: Exception) -> str:
    def clean(text: str) -> list[str]:
        return [ln.strip() for ln in text.splitlines()
                if ln.strip() and not ln.strip().startswith(("full_key", "reference_type", "object_type", "To append"))]

    text = str(e)
    lines = clean(text)
    if "Could not find" in text and "Available options" in text:
        idx = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        options = []
        for ln in lines[idx + 1:]:
            if ln.startswith("Config search path"):
                break
            options.append(ln)
        return f"{lines[0]} (available: {', '.join(options)})"
    if e.__cause__ is not None:
        lines += clean(str(e.__cause__))
    return " ".join(lines)


class _SigtermOutsideTraining(BaseException):
    """SIGTERM while no training loop holds the signal (composing, planning, verifying a checkpoint)."""


def _raise_sigterm(signum, frame) -> None:
    raise _SigtermOutsideTraining()


def cli() -> None:
    """Console-script and ``python -m hyperpar`` entry."""
    import signal

    from hyperpar.launch import under_torchrun

    # Until the training loop (or the elastic agent) takes SIGTERM over, it used to kill the driver
    # silently with exit 143; the docs promise a preempted run exits 0 with a line saying what happened.
    import threading

    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there
    previous = signal.signal(signal.SIGTERM, _raise_sigterm) if main_thread else None
    try:
        preflight(sys.argv[1:])
        if under_torchrun() and int(os.environ.get("RANK", 0)) != 0:
            # Only rank 0 writes shared outputs (.hydra/, the Hydra log); others log to logs/rank_<r>.log.
            sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
        main()
    except KeyboardInterrupt:
        # Ctrl-C before the training loop took over SIGINT (composing, importing, building): nothing to save.
        print("[hyperpar] interrupted (Ctrl-C) before training started: nothing saved", file=sys.stderr)
        sys.exit(130)
    except _SigtermOutsideTraining:
        print("[hyperpar] preempted (SIGTERM) outside the training loop: nothing saved", file=sys.stderr)
        sys.exit(0)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)  # an in-process caller (tests) gets its own handler back
