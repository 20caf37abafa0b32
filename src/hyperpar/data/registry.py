"""name -> dataset builder. ``data.type`` picks one; ``auto`` means the model's own default."""

from __future__ import annotations

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
_BUILDERS: dict[str, Builder] = {}


def register_dataset(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"data type '{name}' registered twice")
        _BUILDERS[name] = fn
        return fn

    return deco


def _load_builtin() -> None:
    import hyperpar.data.dummy  # noqa: F401
    for optional in ("vl_dummy", "hf", "preset", "megatron_source"):
        try:
            __import__(f"hyperpar.data.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"hyperpar.data.{optional}":
                raise


def available() -> list[str]:
    _load_builtin()
    return sorted(_BUILDERS)


def build_dataset(type: str = "auto", *, context: DataContext, **options: Any) -> SampleSource:
    """The data group's ``_target_``: ``options`` are the data config's fields."""
    _load_builtin()
    name = context.default_type if type == "auto" else type
    if name not in _BUILDERS:
        raise ConfigError(f"unknown data.type '{name}'", hint=f"available: {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[name](options, context)
