"""Hugging Face model directories in and out: config.json + safetensors (single file or sharded).

Reading is one tensor at a time through ``safe_open`` so a caller (every rank of a distributed
load) touches only what it needs; ``from_hf`` builds the model on meta and fills it in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hyperpar.errors import CheckpointError, MissingKeyError
from hyperpar.models.fused import join_parts
from hyperpar.models.lazy_tensor import LazyTensor
from hyperpar.models.spec import ModelSpec, registered_models, spec_for_hf_config, spec_of_model

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class HFCheckpoint:
    """Read-only view of a Hugging Face model directory.

    ``.config`` is config.json as a dict; ``keys()`` lists the tensor names; ``read(key)`` loads one
    tensor (CPU, stored dtype). Open file handles are kept until ``close()`` / the ``with`` block ends.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint path '{self.path}' does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint path '{self.path}' is not a directory", hint="give the model directory")
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(
                f"'{self.path}' has no config.json", hint="a Hugging Face model directory holds config.json + *.safetensors"
            )
        try:
            self.config: dict[str, Any] = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"'{cfg_file}' is not valid JSON: {e}") from None
        self._weight_map = self._find_weights()
        self._handles: dict[str, Any] = {}

    def _find_weights(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"'{index}' is not a valid safetensors index: {e}") from None
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise CheckpointError(f"'{self.path}': shard files listed in {INDEX_NAME} are missing: {', '.join(missing[:3])}")
            return dict(weight_map)
        files = [self.path / SINGLE_NAME] if (self.path / SINGLE_NAME).is_file() else sorted(self.path.glob("*.safetensors"))
        if not files:
            hint = "pytorch_model.bin is not supported; save with safetensors" if any(self.path.glob("*.bin")) else None
            raise CheckpointError(f"'{self.path}' has no *.safetensors weights", hint=hint)
        weight_map: dict[str, str] = {}
        for f in files:
            try:
                with safe_open(f, framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read '{f}': {e}") from None
        return weight_map

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def __contains__(self, key: object) -> bool:
        return key in self._weight_map

    def _handle(self, key: str) -> Any:
        if key not in self._weight_map:
            raise MissingKeyError(f"'{self.path}' has no tensor '{key}'")
        fname = self._weight_map[key]
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(self.path / fname, framework="pt")
            except Exception as e:
                raise CheckpointError(f"cannot read '{self.path / fname}': {e}") from None
        return self._handles[fname]

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """safetensors' own error types (a shard cut short, an index naming the wrong shard) as one line."""
        try:
            yield
        except Exception as e:
            raise CheckpointError(f"cannot read tensor '{key}' from '{self.path / self._weight_map[key]}': {e}",
                                  hint=f"the file or {INDEX_NAME} is damaged: copy the checkpoint again") from None

    def _slice(self, key: str) -> Any:
        handle = self._handle(key)
        with self._reading(key):
            return handle.get_slice(key)

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` on CPU in its stored dtype."""
        handle = self._handle(key)
        with self._reading(key):
            return handle.get_tensor(key)

    def read_lazy(self, key: str) -> LazyTensor:
        """``key`` as a LazyTensor: indexing it reads only that box (``safe_open(...).get_slice``)."""
        sl = self._slice(key)
        shape = tuple(sl.get_shape())
        dtype = _ST_DTYPES.get(sl.get_dtype(), torch.float32)

        def fetch(index: tuple[slice, ...]) -> torch.Tensor:
            if not shape:
                return self.read(key)
            with self._reading(key):
                return sl[index]

        return LazyTensor(shape, dtype, fetch)

    def read_meta(self, key: str) -> torch.Tensor:
        """A meta tensor with ``key``'s shape and dtype (reads only the header)."""
        sl = self._slice(key)
        return torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.float32), device="meta")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _list(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_checkpoint(model: nn.Module, adapter: Any, ckpt: HFCheckpoint) -> set[str]:
    """Raise one CheckpointError naming the first missing / wrongly shaped tensors, before any load.

    Returns the checkpoint keys the model reads (headers only: nothing is loaded)."""
    missing: list[str] = []
    wrong: list[str] = []
    used: set[str] = set()

    def read_meta(key: str) -> torch.Tensor:
        t = ckpt.read_meta(key)
        used.add(key)
        return t

    # remove_duplicate=False: a tied lm_head still reads its own key when the file has one
    for name, p in model.named_parameters(remove_duplicate=False):
        try:
            t = adapter.load_param(name, read_meta)
        except KeyError:  # MissingKeyError; any other CheckpointError (a damaged shard) is its own line
            missing.append(name)
            continue
        if tuple(t.shape) != tuple(p.shape):
            wrong.append(f"{name} {tuple(t.shape)} != expected {tuple(p.shape)}")
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_list(missing)}")
        if wrong:
            parts.append(f"wrong shape {len(wrong)}: {_list(wrong)}")
        hint = "is config.json from the same checkpoint as the weights?"
        if missing and not wrong and all(n.startswith("mtp.") for n in missing):
            # transformers' save_pretrained keeps mtp_num_hidden_layers in config.json but drops mtp.*;
            # fit_to_checkpoint builds without them unless model.mtp_loss_weight trains them
            hint = "the checkpoint has no MTP weights to train: model.mtp_loss_weight=0 builds the model without them"
        raise CheckpointError(f"'{ckpt.path}' does not match the model config: {'; '.join(parts)}", hint=hint)
    return used


def audit_checkpoint(
    model: nn.Module,
    adapter: Any,
    ckpt: HFCheckpoint,
    *,
    left_out: Sequence[tuple[str, str]] = (),
    allow_unused: bool = False,
) -> str | None:
    """Check shapes (``check_checkpoint``) and that the model reads every tensor of the checkpoint.

    ``left_out``: (key prefix, what it is) pairs the caller chose to leave out (the vision tower of a
    text-only load, the layers an override cut). Any other unread tensor is refused with one
    CheckpointError naming a few, unless ``allow_unused``. Returns one line saying what was left
    out (None when the model reads everything); the caller logs it.
    """
    used = check_checkpoint(model, adapter, ckpt)
    unused = [k for k in ckpt.keys() if k not in used]
    groups: dict[str, list[str]] = {}
    unknown: list[str] = []
    for key in unused:
        label = next((lab for prefix, lab in left_out if key.startswith(prefix)), None)
        if label is None:
            unknown.append(key)
        else:
            groups.setdefault(label, []).append(key)
    if unknown and not allow_unused:
        raise CheckpointError(
            f"'{ckpt.path}' holds {len(unknown)} tensors the model does not use: {_list(unknown)}",
            hint="is config.json from the same checkpoint as the weights? model.allow_unused_weights=true "
            "(from_hf(..., allow_unused=True)) loads without them",
        )
    if unknown:
        groups[f"unused ({_list(unknown)})"] = unknown
    if not groups:
        return None
    parts = ", ".join(f"{label} ({len(keys)} tensors)" for label, keys in groups.items())
    return f"'{ckpt.path}': left out {len(unused)} of {len(ckpt.keys())} checkpoint tensors: {parts}"


def fit_to_checkpoint(args: Any, keys: Sequence[str]) -> tuple[Any, list[tuple[str, str]], list[str]]:
    """What a checkpoint holds, or lacks, beside what its config.json describes, read as transformers
    reads it. Returns (args, left-out (key prefix, what) pairs for ``audit_checkpoint``, notes to log).

    - ``mtp.*``: released checkpoints carry a multi-token-prediction module that transformers does
      not model: it ignores those tensors, and its ``save_pretrained`` writes none while config.json
      keeps ``mtp_num_hidden_layers``. A family without MTP leaves them out; a family with MTP whose
      checkpoint has none is built without it, unless ``mtp_loss_weight`` trains it (then the
      tensors are reported missing).
    - a zero-width shared expert (``shared_expert_intermediate_size: 0``): transformers writes its
      empty projections and a gate that scales zeros; there is nothing to load.
    """
    text = getattr(args, "text", args)
    left_out: list[tuple[str, str]] = []
    notes: list[str] = []
    has_mtp = any(k.startswith("mtp.") for k in keys)
    if not hasattr(text, "mtp_num_hidden_layers"):
        if has_mtp:
            left_out.append(("mtp.", "the MTP module (not part of this family, nor of transformers' model)"))
    elif text.mtp_num_hidden_layers > 0 and not has_mtp and not (getattr(args, "mtp_loss_weight", 0) or text.mtp_loss_weight):
        notes.append(f"config.json says mtp_num_hidden_layers={text.mtp_num_hidden_layers} but the checkpoint has no "
                     "mtp.* tensors (transformers' save_pretrained writes none): built without the MTP module")
        text = dataclasses.replace(text, mtp_num_hidden_layers=0)
        args = args.replace(text=text) if hasattr(args, "text") else text
    if getattr(text, "shared_expert_intermediate_size", None) == 0:
        cut = ".mlp.shared_expert"
        prefixes = sorted({k[:k.index(cut) + len(cut)] for k in keys if cut in k})
        left_out += [(p, "the zero-width shared expert (shared_expert_intermediate_size 0)") for p in prefixes]
    return args, left_out, notes


def is_vl_config(config: dict[str, Any]) -> bool:
    """A composite vision-language config.json (``vision_config``, or a ``*ForConditionalGeneration``)."""
    archs = config.get("architectures") or []
    return isinstance(config.get("vision_config"), dict) or any(str(a).endswith("ForConditionalGeneration") for a in archs)


def is_vl_spec(spec: ModelSpec) -> bool:
    return any(f.name == "vision" for f in dataclasses.fields(spec.args_cls))


def spec_for_checkpoint(config: dict[str, Any], text_only: bool = False) -> ModelSpec:
    """The family that reads a config.json: its VL form for a VL checkpoint, or with ``text_only``
    the text family of the same ``model_type``."""
    spec = spec_for_hf_config(config)
    if not is_vl_config(config):
        return spec
    model_type = str(config.get("model_type", ""))
    candidates = [s for s in registered_models().values() if model_type in s.hf_model_types]
    if text_only:
        text = next((s for s in candidates if not is_vl_spec(s)), None)
        if text is None:
            raise CheckpointError(f"model_type '{model_type}' has no text-only model", hint="load it without text_only")
        return text
    if is_vl_spec(spec):
        return spec
    return next((s for s in candidates if is_vl_spec(s)), spec)


TEXT_ONLY_LEFT_OUT = (("model.visual.", "the vision tower"), ("mtp.", "the MTP module"))


def from_hf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    text_only: bool = False,
    allow_unused: bool = False,
) -> nn.Module:
    """Build the model a Hugging Face directory describes and load its weights (cast to ``dtype``).

    A VL checkpoint builds the VL model; ``text_only=True`` builds its text model and leaves the
    vision tower out (logged in one line). A checkpoint tensor the model does not read is a
    CheckpointError unless ``allow_unused=True`` (then logged).
    """
    with HFCheckpoint(path) as ckpt:
        model_type = ckpt.config.get("model_type")
        if not model_type:
            raise CheckpointError(f"'{ckpt.path}/config.json' has no model_type")
        spec = spec_for_checkpoint(ckpt.config, text_only)
        args, fit_left_out, notes = fit_to_checkpoint(spec.args_cls.from_hf_config(ckpt.config), ckpt.keys())
        for line in notes:
            log.warning("'%s': %s", ckpt.path, line)
        with torch.device("meta"):
            model = spec.model_cls(args)
        adapter = spec.adapter(args)
        left_out = list(TEXT_ONLY_LEFT_OUT if text_only and is_vl_config(ckpt.config) else ()) + fit_left_out
        note = audit_checkpoint(model, adapter, ckpt, left_out=left_out, allow_unused=allow_unused)
        if note:
            log.warning("%s", note)
        model.to(dtype)
        model.to_empty(device=device)
        model.init_buffers()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(adapter.load_param(name, ckpt.read))
    return model


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "2GB" / "500MB" / "10KB" (powers of 1000) / "1GiB" (powers of 1024)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not m:
        raise ValueError(f"cannot parse size '{size}' (use e.g. 2GB, 500MB, 1GiB or an int)")
    unit = m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(m.group(1)) * base**power)


def _spec_of(model: nn.Module) -> ModelSpec:
    return spec_of_model(model)


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor
    t = full_tensor() if full_tensor is not None else t
    return t.detach().to("cpu").contiguous()


def _export_items(model: nn.Module, adapter: Any) -> Iterator[tuple[str, torch.Tensor]]:
    def mapped() -> Iterator[tuple[str, Any]]:
        for name, t in model.state_dict().items():
            yield from adapter.export_param(name, t).items()

    seen: set[str] = set()
    for key, out in join_parts(mapped()):
        if key in seen:
            raise CheckpointError(f"export writes '{key}' twice")
        seen.add(key)
        yield key, out


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's key names and layouts (what ``to_hf`` writes),
    fused tensors concatenated; a tied ``lm_head`` is left out as the checkpoint does."""
    spec = _spec_of(model)
    return {key: _full(t) for key, t in _export_items(model, spec.adapter(getattr(model, "args")))}


def to_hf(model: nn.Module, path: str | Path, max_shard_size: int | str = "2GB") -> None:
    """Write config.json and safetensors (sharded with an index when larger than ``max_shard_size``)
    that ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
    spec = _spec_of(model)
    args = getattr(model, "args")
    adapter = spec.adapter(args)
    limit = parse_size(max_shard_size)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    # Plan shards from sizes only, then materialise one shard at a time.
    items = list(_export_items(model, adapter))
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, t) in enumerate(items):
        size = t.numel() * t.element_size()
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    # Stale weights from an earlier export would shadow or confuse the new ones.
    for old in out.iterdir():
        if old.name in (SINGLE_NAME, INDEX_NAME) or _SHARD_RE.match(old.name):
            old.unlink()

    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, idx in zip(names, shards):
        tensors = {items[i][0]: _full(items[i][1]) for i in idx}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = fname
            total += t.numel() * t.element_size()
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    config = adapter.hf_config()
    dtypes = [t.dtype for _, t in items if t.is_floating_point()]
    if dtypes:
        config["dtype"] = str(dtypes[0]).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = ["HFCheckpoint", "MissingKeyError", "check_checkpoint", "from_hf", "hf_state_dict", "parse_size", "to_hf"]
