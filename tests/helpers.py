"""Shared test helpers: compose a job config like the CLI does, run a job in-process or the CLI in a
subprocess, read what a run wrote. The tiny configs themselves live in fixtures.py."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from fixtures import DETERMINISTIC, SMALL, STEPS

REPO = Path(__file__).resolve().parents[1]


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import hyperpar.cli  # noqa: F401  (registers schemas and resolvers)
    from hyperpar.config import validate_schema

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="hyperpar.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides or [])
    GlobalHydra.instance().clear()
    return validate_schema(cfg)


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HYPERPAR_NO_BAR"] = "1"
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(args: list[str], *, cwd: Path, timeout: float = 600, module: str = "hyperpar") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def read_losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:  # not a skipped step (no labelled token)
            out[rec["step"]] = rec["loss"]
    return out


def run_small(run_dir: Path, overrides: list[str], *, steps: int = STEPS) -> dict[int, float]:
    """One tiny in-process job through the driver's run_job (preflight + worker), like the CLI does."""
    from hyperpar.launch import run_job

    cfg = compose_cfg(["metrics.progress_bar=false", *SMALL, f"train.steps={steps}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    run_job(cfg, str(run_dir))
    return read_losses(run_dir)


def cli_small(run_dir: Path, overrides: list[str], *, env: dict | None = None, timeout: float = 600,
              steps: int = STEPS) -> subprocess.CompletedProcess:
    """One tiny job through the real CLI in a subprocess, writing to ``run_dir``."""
    return subprocess.run([sys.executable, "-m", "hyperpar", *SMALL, f"train.steps={steps}", *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Every field of metrics.jsonl by step (the last record wins)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def cli_metrics(run_dir: Path, overrides: list[str], *, steps: int = STEPS) -> dict[int, dict]:
    """``cli_small`` that must succeed, then ``metrics_by_step``."""
    res = cli_small(run_dir, overrides, steps=steps)
    assert res.returncode == 0, res.stderr[-3000:]
    return metrics_by_step(run_dir)


_REFERENCE_RUNS: dict[tuple, dict[int, dict]] = {}


def strict_steps(single: dict[int, dict], got: dict[int, dict]) -> list[int]:
    """The steps an fp32 layout is held to the 1-process run's per-step bound: every step, or, for an
    MoE model whose routes part at a near-tied token (``metrics.route_counts=true``), the steps before
    that (as the parity report does). Routes that part any other way fail here."""
    from hyperpar.parity.compare import route_split

    steps = sorted(single)
    split = route_split(got, single, steps)
    if split is None:
        return steps
    assert split.near_tie, split.describe()
    print("MoE:", split.describe())
    return [s for s in steps if s < split.step]


def cli_metrics_shared(run_dir: Path, overrides: list[str], *, steps: int = STEPS) -> dict[int, dict]:
    """``cli_metrics``, with the one-process references (``parallel=single``) that several tests compare
    against trained once per session: a run is deterministic, so the same overrides and steps give the
    same records. Overrides naming a test's own paths never match another test's, so those runs are
    not shared; other layouts always run."""
    if "parallel=single" not in overrides:
        return cli_metrics(run_dir, overrides, steps=steps)
    key = (tuple(overrides), steps)
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = cli_metrics(run_dir, overrides, steps=steps)
    return copy.deepcopy(_REFERENCE_RUNS[key])


def records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl deduplicated by step (the last record wins), deterministic fields only."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = {k: rec[k] for k in DETERMINISTIC}
    return out


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The CLI failed with exactly one non-empty stderr line and no traceback; returns that line."""
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    return lines[0]


def hf_named_grads(model) -> dict:
    """The model's gradients under the checkpoint's key names (split parameters fused back), to
    compare with a transformers model's ``named_parameters()`` grads."""
    from hyperpar.models.fused import join_parts
    from hyperpar.models.spec import spec_of_model

    adapter = spec_of_model(model).adapter(model.args)
    grads = ((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
    return dict(join_parts(kv for n, g in grads for kv in adapter.export_param(n, g).items()))


def perturb_(model, seed: int):
    """A transformers model's zero- or one-initialised tensors (offset norms, GDN decays, routers,
    the vision LayerNorms around (1, 0)) set to noise, so a wrong norm or layout cannot hide."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            if "visual" in name and "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + noise)
            elif "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith("mlp.gate.weight"):
                p.copy_(noise)
    return model


def vl_inputs(rows: list[list], *, patch_dim: int, merge: int, ids: tuple[int, int, int, int], seed: int = 0) -> dict:
    """A VL batch as the Qwen-VL processor lays it out (MODELS.md 9.1). Each row lists items: an int
    (that many random text ids < 900), ("image", (t, h, w)) or ("video", (t, h, w)) in patches; rows
    are right-filled with text to one length. ``ids`` = (image, video, vision start, vision end).
    Returns input_ids, labels (placeholders -100), mm_token_type_ids and the pixel values / grids of
    each modality present, items in row-major order."""
    import torch

    img, vid, vs, ve = ids
    g = torch.Generator().manual_seed(seed)
    seqs, types, grids = [], [], {"image": [], "video": []}
    for row in rows:
        seq, typ = [], []
        for item in row:
            if isinstance(item, int):
                seq += torch.randint(0, 900, (item,), generator=g).tolist()
                typ += [0] * item
                continue
            kind, (t, h, w) = item
            grids[kind].append([t, h, w])
            n = h * w // merge**2
            groups = [(img, 1, t * n)] if kind == "image" else [(vid, 2, n)] * t
            for k, (token, code, count) in enumerate(groups):
                stamp = [100 + k, 101 + k] if kind == "video" else []  # the timestamp text of a frame group
                seq += stamp + [vs] + [token] * count + [ve]
                typ += [0] * (len(stamp) + 1) + [code] * count + [0]
        seqs.append(seq)
        types.append(typ)
    S = max(len(s) for s in seqs)
    for seq, typ in zip(seqs, types):
        fill = S - len(seq)
        seq += torch.randint(0, 900, (fill,), generator=g).tolist()
        typ += [0] * fill
    input_ids = torch.tensor(seqs)
    mm = torch.tensor(types, dtype=torch.int32)
    out = {"input_ids": input_ids, "labels": input_ids.masked_fill(mm != 0, -100), "mm_token_type_ids": mm}
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            out[key] = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=g)
            out[f"{kind}_grid_thw"] = grid
    return out


def run_entry(module: str, args: list[str], capfd) -> tuple[int, list[str]]:
    """Run a console entry point (``hyperpar``, ``hyperpar.export``, ``hyperpar.data.megatron.convert``)
    in this process, as its ``python -m`` would: (exit code, non-empty stdout + stderr lines).
    In-process keeps a table of bad-input cases fast (torch and Hydra are imported once)."""
    import importlib
    import logging

    capfd.readouterr()
    saved_argv = sys.argv
    sys.argv = [module, *args]
    code = 0
    try:
        if module == "hyperpar":
            from hyperpar.cli import cli

            cli()
        else:
            code = int(importlib.import_module(module).main(args) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001 - an escaped exception is what `python -m` would print as a traceback
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved_argv
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        for h in list(logging.getLogger().handlers):  # Hydra's job logging: one run's handlers, not the next's
            logging.getLogger().removeHandler(h)
    out = capfd.readouterr()
    return code, [ln for ln in (out.out + out.err).splitlines() if ln.strip()]


# Observations of a run made from inside the worker (see ProbeTrainer), keyed by run dir.
PROBES: dict[str, dict] = {}


@functools.lru_cache(maxsize=None)
def _probe_trainer_cls():
    from hyperpar.train.trainer import Trainer

    class ProbeTrainer(Trainer):
        """The real Trainer, recording what the worker built for it (``trainer._target_=helpers.ProbeTrainer``)."""

        def __init__(self, **kwargs):
            import torch

            from hyperpar import denormals, host_allocator
            from hyperpar.models.layers.moe import GroupedExperts

            super().__init__(**kwargs)
            PROBES[str(kwargs["run_dir"])] = {
                "threads": torch.get_num_threads(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
                # fully_shard renames a wrapped class FSDP<name>
                "checkpointed_blocks": sum("CheckpointWrapper" in type(m).__name__ for m in self.model.modules()),
                "peak_flops": self.peak_flops,
                "host_allocator": host_allocator.applied(),
                "flush_denormals": denormals.flushing(),
                "fused_heads": sum(bool(getattr(m, "fused_loss", False)) for m in self.model.modules()),
                "experts_impl": sorted({m.impl for m in self.model.modules() if isinstance(m, GroupedExperts)}),
            }

    return ProbeTrainer


def __getattr__(name: str):
    # Built lazily so importing helpers does not import torch and the trainer.
    if name == "ProbeTrainer":
        return _probe_trainer_cls()
    raise AttributeError(name)


def close_group(ok: bool) -> None:
    """End a spawned test worker's process group. After a clean run every rank waits for the others
    first: a rank that tears gloo down while a peer is still sending aborts that peer (SIGABRT,
    'terminate called without an active exception')."""
    import torch.distributed as dist

    if ok:
        dist.barrier()
    dist.destroy_process_group()


def exit_spawned_rank() -> NoReturn:
    """End a spawned test rank after a clean run: ``close_group(ok=True)``, then leave without the
    interpreter's finalisation, as the launcher's forked workers do (multiprocessing ends a forked
    child with ``os._exit``). Process groups outlive ``destroy_process_group`` once ``torch._dynamo``
    was imported after ``init_process_group`` or a DTensor op ran: after one cp2 step, 6 gloo
    transport loops and 12 run-loop threads are still alive and are torn down at interpreter exit.
    Spawned ranks, which run that finalisation, aborted about once in 500 runs (SIGABRT, 'terminate
    called without an active exception'), most likely there; the forked CLI workers never did."""
    close_group(ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A local TCP port that was free a moment ago (for a spawned test job's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def conv1d_float64(x, w, go):
    """The causal depthwise conv + silu through ``F.conv1d`` in float64 on x's and w's values, its
    backward from ``go``: (output, x's gradient, w's gradient)."""
    import torch.nn.functional as F

    C, K, S = w.shape[0], w.shape[-1], x.shape[1]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.silu(F.conv1d(x64.transpose(1, 2), w64, padding=K - 1, groups=C)[:, :, :S].transpose(1, 2))
    ref.backward(go.double())
    return ref.detach(), x64.grad, w64.grad
