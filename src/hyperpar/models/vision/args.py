"""Geometry of the Qwen3-VL vision tower and its mapping to/from a ``vision_config`` (MODELS.md 2.6).

One dataclass for both VL families: Qwen3.5 towers have no DeepStack (``deepstack_visual_indexes``
empty), Qwen3-VL-MoE towers list the blocks whose outputs feed the DeepStack mergers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hyperpar.errors import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _int_or_first(value: Any, name: str) -> int:
    """transformers allows ``patch_size`` / ``temporal_patch_size`` as an int or a list of equal ints."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"vision_config.{name}={list(value)}: only equal sizes are supported")
        value = value[0]
    return int(value)


@dataclass
class VisionArgs:
    depth: int = 27
    hidden_size: int = 1152  # Dv
    hidden_act: str = "gelu_pytorch_tanh"  # block MLP; the mergers always use exact GELU
    intermediate_size: int = 4304  # Iv
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584  # Dout, must equal the text hidden size
    num_position_embeddings: int = 2304  # a perfect square
    deepstack_visual_indexes: list[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    model_type: str = "qwen3_vl_moe_vision"

    def __post_init__(self) -> None:
        self.deepstack_visual_indexes = [int(i) for i in self.deepstack_visual_indexes]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, hint: str | None = None) -> ConfigError:
            return ConfigError(f"vision: {msg}", hint=hint)

        if self.hidden_size % self.num_heads:
            raise bad(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise bad(f"head dim {self.head_dim} must be a multiple of 4 (2-D rotary splits it into h and w halves)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise bad(f"num_position_embeddings {self.num_position_embeddings} is not a perfect square")
        if self.hidden_act not in ACTIVATIONS:
            raise bad(f"hidden_act '{self.hidden_act}' is not supported", hint=f"use one of {', '.join(ACTIVATIONS)}")
        wrong = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if wrong or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise bad(f"deepstack_visual_indexes {self.deepstack_visual_indexes} must be distinct block indices < depth {self.depth}")
        for name in ("depth", "patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "out_hidden_size"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one ``pixel_values`` row: C · Tp · P · P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per merged (text) token: m²."""
        return self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "VisionArgs":
        """From a ``vision_config`` dict; absent fields take transformers' class defaults."""
        rope = dict(d.get("rope_parameters") or {})
        model_type = str(d.get("model_type", "qwen3_vl_moe_vision"))
        # Qwen3-VL-MoE's class default is [8, 16, 24]; Qwen3.5 vision configs have no such field.
        deepstack = d.get("deepstack_visual_indexes", [8, 16, 24] if "vl_moe" in model_type else [])
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ConfigError(f"vision: rope_type '{rope_type}' is not supported", hint="only 'axial' is")
        return cls(
            depth=int(d.get("depth", d.get("num_hidden_layers", 27))),
            hidden_size=int(d.get("hidden_size", 1152)),
            hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
            intermediate_size=int(d.get("intermediate_size", 4304)),
            num_heads=int(d.get("num_heads", d.get("num_attention_heads", 16))),
            in_channels=int(d.get("in_channels", 3)),
            patch_size=_int_or_first(d.get("patch_size", 16), "patch_size"),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            temporal_patch_size=_int_or_first(d.get("temporal_patch_size", 2), "temporal_patch_size"),
            out_hidden_size=int(d.get("out_hidden_size", 3584)),
            num_position_embeddings=int(d.get("num_position_embeddings", 2304)),
            deepstack_visual_indexes=list(deepstack),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            model_type=model_type,
        )

    def to_hf_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "out_hidden_size": self.out_hidden_size,
            "num_position_embeddings": self.num_position_embeddings,
            "initializer_range": self.initializer_range,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }
        if self.deepstack_visual_indexes or "vl_moe" in self.model_type:
            out["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        return out

    def replace(self, **changes: Any) -> "VisionArgs":
        return type(self)(**{**asdict(self), **changes})
