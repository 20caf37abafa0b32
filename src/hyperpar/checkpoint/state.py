"""What a checkpoint holds, and the checks that run before any of it is loaded.

Tensors (model parameters and optimizer state, FSDP2 DTensors) go through
``torch.distributed.checkpoint`` so a checkpoint saved on one layout loads on another (DCP reshards).
Everything else is JSON: trainer counters, LR scheduler, data loader, the optimizer's non-tensor
param-group options, and per-rank RNG states. Nothing we write is a pickle, and the DCP state dict
holds tensors only, so loading never unpickles a value; DCP's own ``.metadata`` index is read with an
allow-list unpickler (``safe_metadata``), so a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from hyperpar.errors import CheckpointError

_FORMAT = 1


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer keys ("state.<param fqn>.exp_avg") are layout-independent, which is what
    # lets DCP reshard the optimizer like the model.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _parts(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _optim_holder(parts: list[nn.Module]) -> nn.Module:
    """The module the optimizer was built on (``PipelineStep.optim_model``): the one part, or a
    ``ModuleList`` of them, whose names carry a "<part index>." prefix."""
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def _canonical_optim_keys(osd: dict[str, Any], n_parts: int) -> dict[str, Any]:
    """Optimizer keys without the part index: "state.<i>.<fqn>..." -> "state.<fqn>..." (each part
    keeps the whole model's names, so the keys are the one-process run's, whatever the pipeline)."""
    if n_parts == 1:
        return osd
    out = {}
    for k, v in osd.items():
        top, i, rest = k.split(".", 2)
        out[f"{top}.{rest}"] = v
    return out


def _part_optim_keys(osd: dict[str, Any], parts: list[nn.Module]) -> dict[str, Any]:
    """The inverse of ``_canonical_optim_keys``: each key gets the index of the part holding its parameter."""
    if len(parts) == 1:
        return osd
    from hyperpar.models.param_names import canonical_name

    owner = {canonical_name(n): i for i, part in enumerate(parts) for n, _ in part.named_parameters()}
    names = set(owner)
    out = {}
    for k, v in osd.items():
        top, rest = k.split(".", 1)
        out[f"{top}.{owner[_owner(rest, names)]}.{rest}"] = v
    return out


def split_state(model: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for DCP: {"model": ..., "optim": ...}, the optimizer's non-tensor entries).

    ``model``: the module, or the list of model parts of this rank (pipeline stages: each keeps the
    whole model's names, so their state dicts merge into a subset of the one-process run's keys).
    Parameter names are canonical (no activation-checkpoint or compile wrapper segments), so a
    checkpoint does not depend on those settings either.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from hyperpar.distributed.one_rank_cast import settle

    parts = _parts(model)
    settle(parts)  # never a forward's 16-bit casts (distributed/one_rank_cast.py)
    msd: dict[str, Any] = {}
    for part in parts:
        msd.update(get_model_state_dict(part, options=_options()))
    osd = _canonical_optim_keys(get_optimizer_state_dict(_optim_holder(parts), optimizer, options=_options()), len(parts))
    optim_tensors = {k: v for k, v in osd.items() if isinstance(v, torch.Tensor)}
    optim_other = {k: v for k, v in osd.items() if not isinstance(v, torch.Tensor)}
    return {"model": msd, "optim": optim_tensors}, optim_other


def to_json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [to_json_value(v) for v in value]
    if isinstance(value, list):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's JSON state")


def _like(value: Any, template: Any) -> Any:
    """JSON value back in the template's container type (tuples come back as lists)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(_like(v, t) for v, t in zip(value, template)) if len(value) == len(template) else tuple(value)
    return value


def flat_keys(tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DCP's flattened names for our two-level state dict ("model.<fqn>", "optim.<key>")."""
    return {f"{top}.{k}": v for top, sub in tensors.items() for k, v in sub.items()}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: every name after the first that shares a tensor, mapped to the first."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def untrained_params(metadata, tensors: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Parameters whose optimizer state the checkpoint lacks entirely while it holds their values.

    AdamW creates a parameter's state at its first gradient, so a parameter that never got one
    (the MTP head at ``mtp_loss_weight=0``, a vision tower on text-only batches) is saved without
    state, while the load template (DCP fills it with a zero-gradient step) has state for all.
    """
    saved = metadata.state_dict_metadata
    params = set(tensors["model"])
    keys: dict[str, list[str]] = {}
    for key in tensors["optim"]:
        if key.startswith("state."):
            keys.setdefault(_owner(key[len("state."):], params), []).append(key)
    out = sorted(fqn for fqn, ks in keys.items() if f"model.{fqn}" in saved and not any(f"optim.{k}" in saved for k in ks))
    # Every step trains something, so a checkpoint with no optimizer state at all is not one a run
    # saved mid-training: let the compatibility check report it as missing.
    return [] if len(out) == len(keys) else out


def _owner(rest: str, params: set[str]) -> str:
    """The parameter an optimizer-state key "<fqn>.<state name>" belongs to (a name may be nested)."""
    head = rest
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in params:
            return head
    return rest


def without_state(tensors: dict[str, dict[str, torch.Tensor]], untrained: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``tensors`` less the optimizer state of ``untrained`` (the same tensor objects: DCP loads in place)."""
    if not untrained:
        return tensors
    prefixes = tuple(f"state.{fqn}." for fqn in untrained)
    return {**tensors, "optim": {k: v for k, v in tensors["optim"].items() if not k.startswith(prefixes)}}


def model_template(model: nn.Module, metadata) -> dict[str, torch.Tensor]:
    """An unsharded model's state dict as DCP load targets; a tied alias the checkpoint lacks is left out."""
    aliases = tied_aliases(model)
    saved = metadata.state_dict_metadata
    return {k: v for k, v in model.state_dict().items() if not (k in aliases and f"model.{k}" not in saved)}


# ---- checks before loading ----------------------------------------------------------------------
def read_metadata(path: Path):
    from hyperpar.checkpoint.safe_metadata import read_metadata_file

    meta_file = path / ".metadata"
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint '{path}' has no .metadata (not a torch.distributed.checkpoint directory)")
    try:
        return read_metadata_file(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable index is a damaged checkpoint, whatever the error type
        raise CheckpointError(f"checkpoint '{path}': .metadata is corrupt or truncated ({type(e).__name__}: {e})") from None


def check_files(path: Path, metadata) -> None:
    """Every data file is present and long enough for the byte ranges the index points into."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint '{path}' is missing its data file '{rel}'", hint="the checkpoint was copied incompletely")
        size = f.stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint file '{f}' is truncated: {size} bytes, the index needs {end}",
                                  hint="the checkpoint was copied incompletely or the disk filled up; use an earlier checkpoint")


def short_list(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_compatible(path: Path, metadata, tensors: dict[str, dict[str, torch.Tensor]], saved_model: str | None,
                     current_model: str, elsewhere: set[str] = frozenset()) -> None:
    """Raise one CheckpointError naming the first missing / unexpected / wrongly shaped tensors
    (pass ``without_state(tensors, untrained_params(...))``: no state for an untrained parameter is no mismatch).
    ``elsewhere``: flat keys other ranks load (pipeline stages), not unexpected here."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: v for k, v in metadata.state_dict_metadata.items()}
    ours = flat_keys(tensors)
    missing, unexpected, wrong = [], [], []
    for top in tensors:  # model first: its names say the most
        prefix = top + "."
        for key, t in ours.items():
            if not key.startswith(prefix):
                continue
            md = saved.get(key)
            if md is None or not isinstance(md, TensorStorageMetadata):
                missing.append(key)
            elif tuple(md.size) != tuple(t.shape):
                wrong.append(f"{key} {tuple(md.size)} in checkpoint != {tuple(t.shape)} expected")
        unexpected += [k for k in saved if k.startswith(prefix) and k not in ours and k not in elsewhere]
    if not (missing or unexpected or wrong):
        return
    parts = []
    if wrong:
        parts.append(f"wrong shape {len(wrong)}: {short_list(wrong)}")
    if missing:
        parts.append(f"missing {len(missing)}: {short_list(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {short_list(unexpected)}")
    origin = f" (saved for {saved_model}, this run is {current_model})" if saved_model and saved_model != current_model else ""
    raise CheckpointError(f"checkpoint '{path}' does not match the model{origin}: {'; '.join(parts)}",
                          hint="resume with the model config that wrote the checkpoint (its config.yaml is next to it)")


def load_tensors(path: Path, tensors: dict[str, dict[str, torch.Tensor]], *, no_dist: bool = False) -> None:
    """``dcp.load`` in place (resharding to this run's layout); read errors become one CheckpointError."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException as DCPException

    from hyperpar.checkpoint.safe_metadata import SafeFileSystemReader

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, DCPException) as e:  # noqa: BLE001 - DCP wraps per-rank read errors (a BaseException)
        inner = [v[0] for v in getattr(e, "failures", {}).values() if isinstance(v, tuple) and v]
        if any(isinstance(x, CheckpointError) for x in inner):  # ours, e.g. the safe reader refusing an item
            raise next(x for x in inner if isinstance(x, CheckpointError)) from None
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"cannot read checkpoint '{path}': {type(e).__name__}: {first}",
                              hint="the checkpoint is damaged; use an earlier one") from None


def apply_model_optim(model: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer, tensors: dict[str, Any],
                      optim_other_template: dict[str, Any], optim_other_saved: dict[str, Any],
                      untrained: Iterable[str] = ()) -> None:
    """Load ``tensors`` into the model (or this rank's model parts) and the optimizer; ``untrained``
    parameters end with no optimizer state, as in the run that saved them, so AdamW starts their
    state fresh at their first gradient."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from hyperpar.models.param_names import canonical_name

    parts = _parts(model)
    other = {k: _like(optim_other_saved[k], v) if k in optim_other_saved else v for k, v in optim_other_template.items()}
    for part in parts:
        own = {canonical_name(n) for n, _ in part.named_parameters(remove_duplicate=False)}
        own |= {canonical_name(n) for n, _ in part.named_buffers()}
        set_model_state_dict(part, {k: v for k, v in tensors["model"].items() if k in own}, options=_options())
    set_optimizer_state_dict(_optim_holder(parts), optimizer, _part_optim_keys({**tensors["optim"], **other}, parts),
                             options=_options())
    if untrained:
        by_name = {canonical_name(n): p for part in parts for n, p in part.named_parameters()}
        for fqn in untrained:
            optimizer.state.pop(by_name[fqn])  # the state DCP's zero-gradient step made for the template


# ---- RNG ----------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device_type: str = "cpu") -> dict[str, Any]:
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    if device_type != "cpu":
        mod = getattr(torch, device_type)
        out["device"] = {"type": device_type, "state": _b64(mod.get_rng_state())}
    return out


def set_rng_state(state: dict[str, Any], device_type: str = "cpu") -> None:
    try:
        version, st, gauss = state["python"]
        random.setstate((version, tuple(st), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_unb64(state["torch_cpu"]))
        dev = state.get("device")
        if dev and dev.get("type") == device_type and device_type != "cpu":
            getattr(torch, device_type).set_rng_state(_unb64(dev["state"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint RNG state is corrupt ({type(e).__name__}: {e})") from None


FORMAT = _FORMAT
