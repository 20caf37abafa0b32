"""ModelBuilder: the ``_target_`` of the model config group.

It resolves the geometry (a named flavour, or the config.json of ``hf_path``), builds the model on
the meta device, and materialises it after parallelisation: fresh init or the checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyperpar.errors import CheckpointError, ConfigError
from hyperpar.models.spec import ModelSpec, get_model_spec


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


class ModelBuilder:
    def __init__(
        self,
        name: str = "qwen3_5",
        flavor: str = "debug",
        hf_path: str | None = None,
        load_weights: bool = True,
        mtp_loss_weight: float = 0.0,
        default_data: str = "dummy",
    ) -> None:
        self.spec: ModelSpec = get_model_spec(name)
        self.name = name
        self.flavor = flavor
        self.hf_path = hf_path
        self.load_weights = load_weights and hf_path is not None
        self.mtp_loss_weight = mtp_loss_weight
        self.default_data = default_data
        if hf_path:
            self.hf_config = read_hf_config(hf_path)
            model_type = self.hf_config.get("model_type", "")
            if self.spec.hf_model_types and model_type not in self.spec.hf_model_types:
                raise ConfigError(
                    f"model.hf_path has model_type '{model_type}', but model={name} loads {', '.join(self.spec.hf_model_types)}",
                    hint="choose the matching model group",
                )
            self.args = self.spec.args_cls.from_hf_config(self.hf_config)
        else:
            self.hf_config = None
            self.args = self.spec.args_for(flavor)
        if mtp_loss_weight and hasattr(self.args, "mtp_loss_weight"):
            self.args = dataclasses.replace(self.args, mtp_loss_weight=mtp_loss_weight)

    def geometry(self) -> dict[str, int]:
        """Sizes ParallelDims checks divisibility against; absent features are 0."""
        a = self.args
        text = getattr(a, "text", a)
        out = {}
        for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                    "num_experts", "num_hidden_layers"):
            out[key] = int(getattr(text, key, 0) or 0)
        vision = getattr(a, "vision", None)
        if vision is not None:
            out["vision_num_heads"] = int(getattr(vision, "num_heads", 0) or 0)
        if "linear_attention" not in (getattr(text, "layer_types", None) or []):
            out["linear_num_key_heads"] = out["linear_num_value_heads"] = 0
        return out

    def build_meta(self) -> nn.Module:
        with torch.device("meta"):
            return self.spec.model_cls(self.args)

    def weight_source(self):
        """A ``source(name, shape)`` for materialize() that reads this checkpoint, or None for fresh init."""
        if not self.load_weights:
            return None
        from hyperpar.models.hf_io import HFCheckpoint

        ckpt = HFCheckpoint(self.hf_path)
        adapter = self.spec.adapter(self.args)

        def source(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            tensor = adapter.load_param(name, ckpt.read)
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{self.hf_path}: parameter {name} has shape {tuple(tensor.shape)} in the checkpoint, model expects {shape}")
            return tensor.float()

        return source

    def describe(self) -> str:
        src = f"hf_path={self.hf_path}" if self.hf_path else f"flavor={self.flavor}"
        return f"{self.name} ({src})"
