"""Geometry overrides on top of a config.json (``model.num_hidden_layers=4``, ``model.overrides.*``).

The overrides edit the config.json dict before the family reads it, so a checkpoint's own geometry
and an override go through the same reader. Cutting a stack (text layers, MTP layers, vision
blocks) keeps its first entries: per-layer lists (``layer_types``, ``mlp_only_layers``, DeepStack
indexes) are cut to match, and the checkpoint tensors of the cut entries are returned as
(key prefix, what it is) pairs for the load to leave out and report. Keys are checked after the
family has read the config: an override that names no field, or that the reader did not take
(a value the config sets elsewhere), is a ConfigError.
"""

from __future__ import annotations

import copy
from typing import Any

from hyperpar.errors import ConfigError

LeftOut = list[tuple[str, str]]
_TEXT_PREFIXES = ("model.layers.", "model.language_model.layers.")
_VISION_KEYS = ("vision", "vision_config")


def _cut(kind: str, old: int, new: int, loading: bool) -> None:
    if new < 0:
        raise ConfigError(f"model override {kind}={new} must be ≥ 0")
    if loading and new > old:
        raise ConfigError(f"model override {kind}={new} is more than the checkpoint's {old}",
                          hint="an override on a checkpoint can only cut a stack; model.load_weights=false builds a fresh one")


def _cut_text(text: dict[str, Any], n: int, loading: bool, types_given: bool) -> LeftOut:
    old = int(text.get("num_hidden_layers", n))
    _cut("num_hidden_layers", old, n, loading)
    text["num_hidden_layers"] = n
    if isinstance(text.get("layer_types"), list) and not types_given:
        if n > len(text["layer_types"]):
            raise ConfigError(f"model override num_hidden_layers={n} needs layer types for the added layers",
                              hint="give model.overrides.layer_types with one entry per layer")
        text["layer_types"] = text["layer_types"][:n]
    if isinstance(text.get("mlp_only_layers"), list):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < n]
    label = f"text layers {n}-{old - 1}"
    return [(f"{p}{i}.", label) for i in range(n, old) for p in _TEXT_PREFIXES]


def _cut_mtp(holder: dict[str, Any], m: int, loading: bool) -> LeftOut:
    old = int(holder.get("mtp_num_hidden_layers", 0) or 0)
    _cut("mtp_num_hidden_layers", old, m, loading)
    holder["mtp_num_hidden_layers"] = m
    if m == 0:
        return [("mtp.", "the MTP module")]
    return [(f"mtp.layers.{k}.", f"MTP layers {m}-{old - 1}") for k in range(m, old)]


def _cut_vision(vision: dict[str, Any], d: int, loading: bool) -> LeftOut:
    old = int(vision.get("depth", d))
    _cut("vision.depth", old, d, loading)
    vision["depth"] = d
    left: LeftOut = [(f"model.visual.blocks.{j}.", f"vision blocks {d}-{old - 1}") for j in range(d, old)]
    deep = vision.get("deepstack_visual_indexes")
    if isinstance(deep, list):
        keep = [i for i in deep if i < d]
        if keep != deep[: len(keep)]:
            raise ConfigError(f"model override vision.depth={d} would drop DeepStack levels {deep} out of order",
                              hint="the mergers are numbered by level: only trailing levels can be cut")
        vision["deepstack_visual_indexes"] = keep
        left += [(f"model.visual.deepstack_merger_list.{n}.", "DeepStack mergers") for n in range(len(keep), len(deep))]
    return left


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any], *, loading: bool) -> tuple[dict[str, Any], LeftOut]:
    """(config.json with ``overrides``, checkpoint key prefixes the cut leaves out).

    Flat keys edit the text config (``text_config`` of a composite config); ``vision`` /
    ``vision_config`` hold vision keys. ``loading``: weights come from the checkpoint, so a stack
    can only shrink."""
    cfg = copy.deepcopy(config)
    composite = isinstance(cfg.get("text_config"), dict)
    text = cfg["text_config"] if composite else cfg
    left: LeftOut = []
    # Stack sizes first, so a list given next to them (layer_types) replaces the cut one.
    order = sorted(overrides, key=lambda k: k not in ("num_hidden_layers", "mtp_num_hidden_layers"))
    for key in order:
        value = overrides[key]
        if key in _VISION_KEYS:
            vision = cfg.get("vision_config")
            if not isinstance(vision, dict):
                raise ConfigError("model override vision.* but the model has no vision tower")
            if not isinstance(value, dict):
                raise ConfigError(f"model override {key} must be a mapping of vision fields, got {value!r}")
            for vkey, vvalue in value.items():
                if vkey == "depth":
                    left += _cut_vision(vision, int(vvalue), loading)
                else:
                    _set(vision, vkey, vvalue)
        elif key == "num_hidden_layers":
            left += _cut_text(text, int(value), loading, types_given="layer_types" in overrides)
        elif key == "mtp_num_hidden_layers":
            holder = text if "mtp_num_hidden_layers" in text or "mtp_num_hidden_layers" not in cfg else cfg
            left += _cut_mtp(holder, int(value), loading)
        elif key == "tie_word_embeddings" and composite:
            # A composite (VL) model ties by its top-level flag (the ForConditionalGeneration rule);
            # the text config's own copy alone is ignored by one family and overridden by the other.
            cfg[key] = text[key] = copy.deepcopy(value)
        else:
            _set(text, key, value)
    return cfg, left


# Where a config.json nests its rotary fields (transformers 5; older configs: rope_scaling). The
# families read a rotary field there before the top level, so an override goes to both.
_ROPE_DICTS = ("rope_parameters", "rope_scaling")


def _set(holder: dict[str, Any], key: str, value: Any) -> None:
    holder[key] = copy.deepcopy(value)
    for name in _ROPE_DICTS:
        nested = holder.get(name)
        if isinstance(nested, dict) and key in nested:
            nested[key] = copy.deepcopy(value)


def check_applied(args: Any, overrides: dict[str, Any]) -> None:
    """Every override landed on the args the family built (``args.text`` / ``args.vision``).
    A rotary field (``rope_theta``, ``partial_rotary_factor``, ``mrope_section``) is given flat: it is
    written where the config nests it too (``_set``)."""
    text = getattr(args, "text", args)
    for key, value in overrides.items():
        if key in _VISION_KEYS:
            vision = getattr(args, "vision", None)
            for vkey, vvalue in value.items():
                _check_one(vision, f"vision.{vkey}", vkey, vvalue)
        else:
            _check_one(text, key, key, value)


def _check_one(owner: Any, shown: str, key: str, value: Any) -> None:
    if not hasattr(owner, key):
        raise ConfigError(f"model override {shown}: the model has no such geometry field",
                          hint="use a field name of the checkpoint's config.json (text_config / vision_config)")
    got = getattr(owner, key)
    if got != value and not (isinstance(got, (int, float)) and isinstance(value, (int, float)) and float(got) == float(value)):
        raise ConfigError(f"model override {shown}={value!r} did not take effect (the model reads {got!r})",
                          hint="the config.json sets this field elsewhere (e.g. inside rope_parameters)")
