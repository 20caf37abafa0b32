"""ModelBuilder: the ``_target_`` of the model config group.

It resolves the geometry (a named flavour, or the config.json of ``hf_path``), builds the model on
the meta device, and materialises it after parallelisation: fresh init or the checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hyperpar.errors import CheckpointError, ConfigError
from hyperpar.models.geometry_overrides import apply_overrides, check_applied
from hyperpar.models.layers.moe import EXPERTS_IMPLS, GroupedExperts
from hyperpar.models.spec import ModelSpec, get_model_spec

log = logging.getLogger(__name__)


def read_hf_config(hf_path: str) -> dict[str, Any]:
    path = Path(hf_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"model.hf_path '{hf_path}' does not exist", hint="point it at a local Hugging Face model directory")
    if not path.is_dir():
        raise CheckpointError(f"model.hf_path '{hf_path}' is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"model.hf_path '{hf_path}' has no config.json", hint="a Hugging Face directory holds config.json and *.safetensors")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e.msg} at line {e.lineno})") from None


def _plain_overrides(overrides: Any, num_hidden_layers: int | None) -> dict[str, Any]:
    """One plain dict of overrides (Hydra passes a DictConfig); ``num_hidden_layers`` is the short
    spelling of ``overrides.num_hidden_layers``."""
    out: dict[str, Any] = {}
    if overrides:
        out = OmegaConf.to_container(overrides, resolve=True) if isinstance(overrides, DictConfig) else dict(overrides)
    if num_hidden_layers is not None:
        if out.get("num_hidden_layers", num_hidden_layers) != num_hidden_layers:
            raise ConfigError(f"model.num_hidden_layers={num_hidden_layers} contradicts "
                              f"model.overrides.num_hidden_layers={out['num_hidden_layers']}", hint="give one of them")
        out["num_hidden_layers"] = num_hidden_layers
    return out


class ModelBuilder:
    """``text_only``: train the text model of a VL checkpoint (its vision tower is left out, said in
    one line). ``allow_unused_weights``: load a checkpoint that holds tensors the model does not read
    (said in one line) instead of refusing it. ``num_hidden_layers`` / ``overrides``: geometry on
    top of the checkpoint's config.json or the flavour (``geometry_overrides``)."""

    def __init__(
        self,
        name: str = "qwen3_5",
        flavor: str = "debug",
        hf_path: str | None = None,
        load_weights: bool = True,
        mtp_loss_weight: float = 0.0,
        default_data: str | None = "dummy",
        text_only: bool = False,
        allow_unused_weights: bool = False,
        num_hidden_layers: int | None = None,
        overrides: dict[str, Any] | None = None,
        experts_impl: str = "auto",
    ) -> None:
        self.spec: ModelSpec = get_model_spec(name)
        self.name = name
        self.flavor = flavor
        self.hf_path = hf_path
        self.load_weights = load_weights and hf_path is not None
        self.mtp_loss_weight = mtp_loss_weight
        self.default_data = default_data
        self.text_only = text_only
        self.allow_unused_weights = allow_unused_weights
        self.overrides = _plain_overrides(overrides, num_hidden_layers)
        if experts_impl not in EXPERTS_IMPLS:
            raise ConfigError(f"model.experts_impl={experts_impl!r} is not one of {', '.join(EXPERTS_IMPLS)}")
        self.experts_impl = experts_impl
        self.left_out: list[tuple[str, str]] = []  # checkpoint prefixes this build chose not to load
        if hf_path:
            self.hf_config = read_hf_config(hf_path)
            model_type = self.hf_config.get("model_type", "")
            if self.spec.hf_model_types and model_type not in self.spec.hf_model_types:
                raise ConfigError(
                    f"model.hf_path has model_type '{model_type}', but model={name} loads {', '.join(self.spec.hf_model_types)}",
                    hint="choose the matching model group",
                )
            config, cut = apply_overrides(self.hf_config, self.overrides, loading=self.load_weights)
            self.left_out = self._check_text_only() + cut
        else:
            self.hf_config = None
            if text_only:
                raise ConfigError("model.text_only=true needs model.hf_path (it picks the text model of a VL checkpoint)")
            base = self.spec.args_for(flavor)
            config = apply_overrides(base.to_hf_config(), self.overrides, loading=False)[0] if self.overrides else None
            self.args = base
        if config is not None:
            try:
                self.args = self.spec.args_cls.from_hf_config(config)
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # a wrongly typed config.json field
                from hyperpar.models.hf_config_check import config_read_error

                where = f"{hf_path}/config.json" if hf_path else f"model {name} flavour {flavor} with model.overrides"
                raise config_read_error(where, config, self.spec.args_for(flavor).to_hf_config(), e) from None
            check_applied(self.args, self.overrides)
        if mtp_loss_weight and hasattr(self.args, "mtp_loss_weight"):
            self.args = dataclasses.replace(self.args, mtp_loss_weight=mtp_loss_weight)
        self.fit_notes: list[str] = []  # what fit_to_checkpoint changed, logged when the model is built
        if self.load_weights:
            from hyperpar.models.hf_io import HFCheckpoint, fit_to_checkpoint

            with HFCheckpoint(hf_path) as ckpt:
                self.args, fit_left_out, self.fit_notes = fit_to_checkpoint(self.args, ckpt.keys())
            self.left_out += fit_left_out

    @property
    def auto_data(self) -> str | None:
        """The data type ``data=auto`` resolves to: the model config's ``default_data``, else the
        family's (a VL family reads images)."""
        return self.default_data or self.spec.default_data

    def _check_text_only(self) -> list[tuple[str, str]]:
        """A VL checkpoint loads into a text model only when asked (model.text_only=true); returns
        what such a load leaves out."""
        from hyperpar.models.hf_io import TEXT_ONLY_LEFT_OUT, is_vl_config, is_vl_spec, spec_for_checkpoint

        vl_ckpt, vl_model = is_vl_config(self.hf_config), is_vl_spec(self.spec)
        if self.text_only and vl_model:
            text = spec_for_checkpoint(self.hf_config, text_only=True).name
            raise ConfigError(f"model.text_only=true but model={self.name} is the vision-language model",
                              hint=f"use model={text} model.text_only=true for its text model alone")
        if vl_ckpt and not vl_model:
            if not self.text_only:
                arch = ", ".join(self.hf_config.get("architectures") or []) or "vision_config"
                vl = spec_for_checkpoint(self.hf_config).name
                raise ConfigError(
                    f"model.hf_path is a vision-language checkpoint ({arch}) but model={self.name} is its text model alone",
                    hint=f"use model={vl} to train all of it, or model.text_only=true to leave the vision tower out",
                )
            return list(TEXT_ONLY_LEFT_OUT)
        return []

    def geometry(self) -> dict[str, int]:
        """Sizes ParallelDims checks divisibility against; absent features are 0."""
        a = self.args
        text = getattr(a, "text", a)
        out = {}
        for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                    "num_experts", "num_hidden_layers", "vocab_size", "intermediate_size", "moe_intermediate_size",
                    "shared_expert_intermediate_size"):
            out[key] = int(getattr(text, key, 0) or 0)
        is_moe = getattr(text, "is_moe_layer", None)
        if out["num_experts"] and is_moe is not None and not any(is_moe(i) for i in range(out["num_hidden_layers"])):
            out["num_experts"] = 0  # mlp_only_layers / decoder_sparse_step leave no MoE block: no experts to split
        if out["num_experts"] and (is_moe is None or all(is_moe(i) for i in range(out["num_hidden_layers"]))):
            out["intermediate_size"] = 0  # every FFN is a MoE block: the dense size is unused
        vision = getattr(a, "vision", None)
        if vision is not None:
            out["vision_num_heads"] = int(getattr(vision, "num_heads", 0) or 0)
            out["vision_intermediate_size"] = int(getattr(vision, "intermediate_size", 0) or 0)
        if "linear_attention" not in (getattr(text, "layer_types", None) or []):
            out["linear_num_key_heads"] = out["linear_num_value_heads"] = 0
        return out

    def build_meta(self) -> nn.Module:
        """The model on the meta device; with weights to load, the checkpoint is checked against it
        first (headers only): missing or wrongly shaped tensors, and tensors the model would not
        read, are one CheckpointError; what the build chose to leave out is logged in one line."""
        with torch.device("meta"):
            model = self.spec.model_cls(self.args)
        if self.experts_impl != "auto":
            self._set_experts_impl(model)
        if self.load_weights:
            from hyperpar.models.hf_io import HFCheckpoint, audit_checkpoint

            for line in self.fit_notes:
                log.warning("'%s': %s", self.hf_path, line)
            with HFCheckpoint(self.hf_path) as ckpt:
                note = audit_checkpoint(model, self.spec.adapter(self.args), ckpt, left_out=self.left_out,
                                        allow_unused=self.allow_unused_weights)
            if note:
                log.warning("%s", note)
        return model

    def _set_experts_impl(self, model: nn.Module) -> None:
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        if not experts:
            raise ConfigError(f"model.experts_impl={self.experts_impl} but model={self.name} has no routed experts",
                              hint="leave model.experts_impl=auto")
        for m in experts:
            m.impl = self.experts_impl

    def weight_source(self):
        """A ``source(name, shape, index=None)`` for materialize() that reads the box ``index`` of this
        checkpoint's tensor for a parameter (None: all of it), or None for fresh init."""
        if not self.load_weights:
            return None
        from hyperpar.models.hf_io import HFCheckpoint
        from hyperpar.models.lazy_tensor import read_box

        ckpt = HFCheckpoint(self.hf_path)
        adapter = self.spec.adapter(self.args)

        def source(name: str, shape: tuple[int, ...], index: tuple[slice, ...] | None = None) -> torch.Tensor:
            # Lazy reads: a sharded parameter's rank reads only its box of the checkpoint tensor.
            tensor = adapter.load_param(name, ckpt.read_lazy)
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{self.hf_path}: parameter {name} has shape {tuple(tensor.shape)} in the checkpoint, model expects {shape}")
            return read_box(tensor, index).float()

        return source

    def describe(self) -> str:
        src = f"hf_path={self.hf_path}" if self.hf_path else f"flavor={self.flavor}"
        extra = "".join(f", {k}={v}" for k, v in self.overrides.items())
        if self.experts_impl != "auto":
            extra += f", experts_impl={self.experts_impl}"
        return f"{self.name} ({src}{', text only' if self.text_only else ''}{extra})"
