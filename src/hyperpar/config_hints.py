"""A hint for Hydra's "Could not override 'a.b.c'. Key 'c' is not in struct" errors.

Hydra names the key it cannot set but not why, and the three usual reasons need three different
fixes: a typo (``train.stepz``), a key that another option of the same config group has, or a new
key in a free-form mapping, which Hydra only adds with a leading ``+`` (``++`` adds or sets:
``++model.overrides.vocab_size=100``). ``data.extra`` keys are matched against what each data type
declares it reads (``register_dataset``): ``data.extra.video_fraction`` under ``data=megatron`` is
read by ``data=vl_dummy``, and under ``data=auto`` with a VL model by the default data itself.
The hint is worked out by composing the config again without the failing override, so it only
costs time on the error path.
"""

from __future__ import annotations

import difflib
import re
from importlib import resources

from omegaconf import DictConfig, OmegaConf

_FAILED = re.compile(r"Could not override '([^']+)'")
_MISSING = object()


def _compose(overrides: list[str]) -> DictConfig | None:
    from hyperpar.config import compose_config

    try:
        return compose_config(overrides)
    except Exception:  # noqa: BLE001 - another mistake among the overrides: no hint, the message stands
        return None


def _group_options(group: str) -> list[str]:
    try:
        folder = resources.files("hyperpar.conf") / group
        return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError, ModuleNotFoundError):
        return []


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def unknown_key_hint(message: str, overrides: list[str]) -> str | None:
    """The hint for a failed override of a key the composed config does not have, else None."""
    if "not in struct" not in message and not re.search(r"Key '[^']+' not in '", message):
        return None
    found = _FAILED.search(message)
    if found is None:
        return None
    key = found.group(1)
    parent, _, leaf = key.rpartition(".")
    others = [o for o in overrides if _key_of(o) != key]
    cfg = _compose(others)
    if cfg is None:
        return None
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return None
    if parent == "data.extra":
        return _data_extra_hint(cfg, key, leaf)
    close = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=1, cutoff=0.75)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    group = key.split(".", 1)[0]
    chosen = next((o.split("=", 1)[1] for o in others if _key_of(o) == group and "=" in o), None)
    having = []
    for option in _group_options(group):
        if option == chosen:
            continue
        other = _compose([o for o in others if _key_of(o) != group] + [f"{group}={option}"])
        if other is not None and OmegaConf.select(other, key, default=_MISSING) is not _MISSING:
            having.append(f"{group}={option}")
    free_form = OmegaConf.get_type(node) is dict  # data.extra, model.overrides: new keys take a '+'
    if having and free_form:
        return (f"'{leaf}' is a key of {' / '.join(having)}: choose it, then set {key}; or add it to this "
                f"{group} config with ++{key}=...")
    if having:
        return f"'{leaf}' belongs to {' / '.join(having)}: choose it, then set {key}"
    if free_form:
        return f"to add a new key to {parent}, write ++{key}=..."
    keys = ", ".join(str(k) for k in node.keys())
    return f"{parent or 'the config'} has: {keys}"


def _data_extra_hint(cfg: DictConfig, key: str, leaf: str) -> str:
    """data.extra is free-form in the YAML, but each data type declares the extra keys it reads
    (``register_dataset``): the hint says which type reads this one."""
    from hyperpar.data import registry

    types = registry.declared_extra()
    name = str(cfg.data.type)
    if name == "auto":
        try:
            from hyperpar.config import build

            name = build(cfg.model).auto_data
        except Exception:  # noqa: BLE001 - the model config has its own mistake; hint without it
            name = "auto"
    own = sorted(types.get(name, ()))
    if leaf in own:
        return f"data.type={name} reads it but its config does not set it: write ++{key}=..."
    readers = [f"data={t}" for t, extra in sorted(types.items()) if leaf in extra]
    if readers:
        return f"'{leaf}' is read by {' / '.join(readers)}, not by data.type={name}: choose one, then set ++{key}=..."
    close = difflib.get_close_matches(leaf, own, n=1, cutoff=0.75)
    if close:
        return f"did you mean data.extra.{close[0]}?"
    return f"data.type={name} reads the extra keys: {', '.join(own) or 'none'}"
