"""name -> dataset builder. ``data.type`` picks one; ``auto`` means the model's own default.

Each type declares the data fields and ``data.extra`` keys it reads, so a key that would do nothing
(a typo in ``data.extra``, ``data.prefix`` on json data) is a one-line ConfigError, not silence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from hyperpar.errors import ConfigError


class SampleSource(Protocol):
    """A dataset: ``source[i]`` is a pure function of the global sample index ``i``.

    Each sample is a dict of tensors with at least ``input_ids`` (S,) and ``labels`` (S,), the labels
    already shifted (labels[t] is the target of position t, -100 = ignored).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...


@dataclass
class DataContext:
    """What a builder may need from the rest of the job."""

    seq_len: int
    seed: int
    num_samples: int  # samples the whole run consumes (steps x global batch)
    vocab_size: int
    model_args: Any = None
    default_type: str = "dummy"
    run_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


Builder = Callable[[dict[str, Any], DataContext], SampleSource]


@dataclass(frozen=True)
class DataType:
    build: Builder
    fields: frozenset[str]  # DataConfig fields (besides type and extra) the builder reads
    extra: frozenset[str]  # data.extra keys the builder reads


_TYPES: dict[str, DataType] = {}


def register_dataset(name: str, *, fields: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> Callable[[Builder], Builder]:
    """Register ``name``; ``fields`` / ``extra`` list what the builder reads (anything else is rejected)."""
    def deco(fn: Builder) -> Builder:
        if name in _TYPES:
            raise ValueError(f"data type '{name}' registered twice")
        _TYPES[name] = DataType(fn, frozenset(fields), frozenset(extra))
        return fn

    return deco


def check_options(name: str, options: dict[str, Any]) -> None:
    """Reject a data field changed from its default that type ``name`` does not read, and an extra key
    it does not declare. ``options`` are data config fields (``type`` and ``_target_`` are ignored)."""
    from hyperpar.config import DataConfig

    dtype = _TYPES[name]
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.default is not dataclasses.MISSING}
    for key, value in options.items():
        if key in ("type", "_target_", "extra") or key in dtype.fields:
            continue
        if key not in defaults or value != defaults[key]:
            reads = ", ".join(f"data.{f}" for f in sorted(dtype.fields)) or "no data.* field"
            raise ConfigError(f"data.{key}={value!r} has no effect with data.type={name}",
                              hint=f"{name} reads {reads}; remove the override or pick another data type")
    unknown = sorted(set(options.get("extra") or {}) - dtype.extra)
    if unknown:
        keys = ", ".join(sorted(dtype.extra)) or "none"
        raise ConfigError(f"data.extra.{unknown[0]} is not a key of data.type={name}", hint=f"its extra keys: {keys}")


def _load_builtin() -> None:
    # Importing the builders registers their types.
    import hyperpar.data.dummy  # noqa: F401
    import hyperpar.data.hf  # noqa: F401
    import hyperpar.data.megatron.builder  # noqa: F401
    import hyperpar.data.preset  # noqa: F401
    import hyperpar.data.vl_dummy  # noqa: F401


def available() -> list[str]:
    _load_builtin()
    return sorted(_TYPES)


def declared_extra() -> dict[str, frozenset[str]]:
    """Every registered data type and the ``data.extra`` keys it reads."""
    _load_builtin()
    return {name: t.extra for name, t in _TYPES.items()}


def build_dataset(type: str = "auto", *, context: DataContext, **options: Any) -> SampleSource:
    """The data group's ``_target_``: ``options`` are the data config's fields."""
    _load_builtin()
    name = resolve_type(type, context.default_type)
    check_options(name, options)
    return _TYPES[name].build(options, context)


def resolve_type(type: str, default_type: str) -> str:
    """The registered type ``data.type`` names (``auto``: the model's default); unknown → ConfigError."""
    _load_builtin()
    name = default_type if type == "auto" else type
    if name not in _TYPES:
        raise ConfigError(f"unknown data.type '{name}'", hint=f"available: {', '.join(sorted(_TYPES))}")
    return name
