"""An args dataclass to and from a Hugging Face config.json, from one table of keys per class.

Each args class lists its config.json entries once (``HF_KEYS``), in the order transformers writes
them. Reading takes an absent entry from transformers' class default (the dataclass default unless
the key names another), writing gives every field explicitly, so ``from(to(args)) == args`` for
every family from the same two functions.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from hyperpar.errors import ConfigError

_MISSING = dataclasses.MISSING
_DATACLASS_DEFAULT: Any = type("DataclassDefault", (), {"__repr__": lambda self: "<the dataclass default>"})()
ROPE = "rope_parameters"
log = logging.getLogger("hyperpar")


def note_router_renormalises(text: dict[str, Any], family: str) -> None:
    """transformers' Qwen3.5-MoE and Qwen3-VL-MoE always renormalise the top-k router weights and ignore
    a config's ``norm_topk_prob``; so do we, so that a checkpoint computes the same here and there (and
    an export reloads to the same logits). A config that says false is told so once."""
    if text.get("norm_topk_prob") is False:
        log.warning("%s config.json: norm_topk_prob=false is ignored: the top-k router weights are renormalised, "
                    "as transformers' %s does", family, family)


@dataclass(frozen=True)
class Key:
    """One config.json entry that is an args field."""

    field: str
    cast: Callable[[Any], Any] | None = None  # None: the value as written (token ids: null, int or list)
    default: Any = _DATACLASS_DEFAULT  # transformers' default when absent; unset: the dataclass default
    # a default that depends on fields read before it, (fields, config) -> value
    derive: Callable[[dict[str, Any], dict[str, Any]], Any] | None = None
    name: str | None = None  # the config.json name (written), when not ``field``
    reads: tuple[str, ...] = ()  # the names read, first present wins; unset: (name,)
    rope: bool = False  # inside rope_parameters (older configs: rope_scaling, or the top level)
    or_default: bool = False  # null / 0 / [] count as absent
    write_if: Callable[[Any], bool] | None = None  # written only when true of the args

    @property
    def key(self) -> str:
        return self.name or self.field


@dataclass(frozen=True)
class Fixed:
    """An entry with one value: always written; ``checked``: another value in a config is refused."""

    name: str
    value: Any
    rope: bool = False
    checked: bool = False
    reads: tuple[str, ...] = ()


Entry = Key | Fixed


def replace_keys(keys: tuple[Entry, ...], *, drop: tuple[str, ...] = (), **changes: dict[str, Any]) -> tuple[Entry, ...]:
    """``keys`` without the fields in ``drop`` and with ``changes[field]`` applied to those keys (a
    subclass's table from its parent's)."""
    out = []
    for k in keys:
        name = k.field if isinstance(k, Key) else k.name
        if name in drop:
            continue
        out.append(dataclasses.replace(k, **changes[name]) if name in changes else k)
    return tuple(out)


def _rope_of(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get(ROPE) or config.get("rope_scaling") or {})


def _lookup(config: dict[str, Any], rope: dict[str, Any], names: tuple[str, ...], in_rope: bool) -> tuple[bool, Any]:
    for source in (rope, config) if in_rope else (config,):
        for name in names:
            if name in source:
                return True, source[name]
    return False, None


def _default(cls: type, k: Key, fields: dict[str, Any], config: dict[str, Any]) -> Any:
    if k.derive is not None:
        return k.derive(fields, config)
    if k.default is not _DATACLASS_DEFAULT:
        return k.default
    f = cls.__dataclass_fields__[k.field]
    return f.default if f.default_factory is _MISSING else f.default_factory()


def hf_fields(cls: type, config: dict[str, Any], where: str) -> dict[str, Any]:
    """Constructor fields of ``cls`` read from ``config`` by ``cls.HF_KEYS``."""
    rope = _rope_of(config)
    fields: dict[str, Any] = {}
    for k in cls.HF_KEYS:
        if isinstance(k, Fixed):
            found, value = _lookup(rope if k.rope else config, {}, k.reads or (k.name,), False)
            if k.checked and found and value is not None and value != k.value:
                raise ConfigError(f"{where}: {k.name} {value!r} is not supported", hint=f"only {k.value!r} is")
            continue
        found, value = _lookup(config, rope, k.reads or (k.key,), k.rope)
        if not found or (k.or_default and not value):
            value = _default(cls, k, fields, config)
        fields[k.field] = k.cast(value) if k.cast is not None else value
    return fields


def hf_entries(args: Any) -> dict[str, Any]:
    """The config.json entries of ``args`` by its class's ``HF_KEYS``; rope entries nested in
    ``rope_parameters`` where the first of them stands."""
    out: dict[str, Any] = {}
    for k in type(args).HF_KEYS:
        if isinstance(k, Fixed):
            name, value = k.name, k.value
        elif k.write_if is not None and not k.write_if(args):
            continue
        else:
            name, value = k.key, getattr(args, k.field)
            value = list(value) if isinstance(value, list) else value
        (out.setdefault(ROPE, {}) if k.rope else out)[name] = value
    return out


# The top level of a composite (vision-language) config.json: the special token ids and the flag the
# ForConditionalGeneration class ties by (the text and vision parts are their own args).
VL_KEYS: tuple[Entry, ...] = (
    Key("image_token_id", int),
    Key("video_token_id", int),
    Key("vision_start_token_id", int),
    Key("vision_end_token_id", int),
    Key("tie_word_embeddings", bool),
)
