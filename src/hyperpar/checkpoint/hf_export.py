"""Hugging Face export of a training checkpoint or of the live (sharded) model.

Both paths end in :func:`hyperpar.models.to_hf`, which maps names through the family's
``StateDictAdapter.export_param``: any registered model family exports without code here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hyperpar.checkpoint import directory as d
from hyperpar.checkpoint.state import check_compatible, check_files, load_tensors, model_template, read_metadata, tied_aliases
from hyperpar.errors import CheckpointError
from hyperpar.models.spec import spec_of_model

log = logging.getLogger("hyperpar")


def plain_model(spec, args) -> nn.Module:
    """An unsharded model on CPU with buffers set and parameters uninitialised (to be loaded)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def assign_full_state(spec, args, state: dict[str, torch.Tensor]) -> nn.Module:
    """A model on meta whose parameters become the tensors of a full state dict (no copy: the export's
    peak memory is one full model). Non-persistent buffers stay on meta: enough to export, not to run."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    state = dict(state)
    for alias, source in tied_aliases(model).items():
        if alias not in state and source in state:
            state[alias] = state[source]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"state does not match the model: {' '.join(str(e).split())[:300]}") from None
    return model


def write_hf(model: nn.Module, out_dir: str | Path, *, dtype: torch.dtype | None = None,
             max_shard_size: int | str = "2GB") -> Path:
    from hyperpar.models.hf_io import to_hf

    if dtype is not None:
        model = model.to(dtype)
    out = Path(out_dir)
    to_hf(model, out, max_shard_size=max_shard_size)
    return out


def export_live(model: nn.Module | list[nn.Module], out_dir: str | Path, *, rank: int, pipeline=None,
                max_shard_size: int | str = "2GB") -> Path | None:
    """Collective: gather full tensors from the DTensors to rank 0's CPU, which writes the HF directory.

    ``model``: the module, or this rank's model parts; with ``pipeline`` (pp > 1) each stage's
    full tensors are gathered inside the stage, then its first rank sends them to rank 0 over the
    pipeline group of rank 0 (whose members are exactly the stages' first ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    if pipeline is None:
        # full_state_dict + cpu_offload: every rank takes part in each all-gather, only rank 0 keeps the result.
        full = get_model_state_dict(parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        import torch.distributed as dist

        full = {}
        for part in parts:  # every rank of a stage takes part; each keeps the stage's full tensors
            for k, v in get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)).items():
                full[k] = v.detach().cpu()
        pp_mesh = pipeline.pdims.submesh("pp")
        leader = all(c == 0 for name, c in zip(pipeline.pdims.mesh.mesh_dim_names, pipeline.pdims.mesh.get_coordinate())
                     if name != "pp")
        if leader:  # the pp group of global rank 0
            stages: list = [None] * pipeline.pdims.pp if rank == 0 else None
            dist.gather_object(full, stages, dst=0, group=pp_mesh.get_group())
            if rank == 0:
                full = {k: v for stage in stages for k, v in stage.items()}
    if rank != 0:
        return None
    plain = assign_full_state(spec_of_model(parts[0]), parts[0].args, full)  # FSDP2 wraps it in a subclass
    del full
    return write_hf(plain, out_dir, max_shard_size=max_shard_size)


def find_config(ckpt: Path) -> Path:
    """The run's resolved config.yaml: next to the checkpoint (we copy it there), or two levels up."""
    for cand in (ckpt / d.CONFIG, ckpt.parent.parent / d.CONFIG):
        if cand.is_file():
            return cand
    raise CheckpointError(f"no config.yaml next to '{ckpt}' or in its run directory",
                          hint="pass --config with the resolved config.yaml of the run that saved it")


def load_job_config(path: Path) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - yaml and omegaconf raise several types
        raise CheckpointError(f"cannot read '{path}': {' '.join(str(e).split())}") from None
    if not isinstance(cfg, DictConfig) or "model" not in cfg:
        raise CheckpointError(f"'{path}' has no model section", hint="it must be a hyperpar run's config.yaml")
    return cfg


def load_checkpoint_model(ckpt: str | Path, *, config: str | Path | None = None) -> nn.Module:
    """One process, no process group: the model a DCP checkpoint holds, as a plain CPU module (fp32)."""
    from hyperpar.config import build

    from hyperpar.checkpoint.manager import resolve_intact

    path = resolve_intact(ckpt, what="checkpoint")  # checksums and the safe index reader, before any load
    cfg = load_job_config(Path(config) if config else find_config(path))
    builder = build(cfg.model, load_weights=False)
    model = plain_model(builder.spec, builder.args)
    metadata = read_metadata(path)
    check_files(path, metadata)
    template = model_template(model, metadata)
    check_compatible(path, metadata, {"model": template}, None, builder.describe())
    load_tensors(path, {"model": template}, no_dist=True)  # fills the model's own tensors in place
    return model


def check_out_dir(out_dir: str | Path) -> Path:
    """The export target is a directory we can create or write: not an existing file."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export target '{out}' is an existing file, not a directory",
                              hint="give a new or existing directory for config.json and the safetensors")
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise CheckpointError(f"cannot write the export to '{out}': '{parent}' is not a writable directory")
    return out


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, *, config: str | Path | None = None,
                      dtype: torch.dtype | None = None, max_shard_size: int | str = "2GB") -> Path:
    check_out_dir(out_dir)
    model = load_checkpoint_model(ckpt, config=config)
    return write_hf(model, out_dir, dtype=dtype, max_shard_size=max_shard_size)
