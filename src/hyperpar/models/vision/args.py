"""Geometry of the Qwen3-VL vision tower and its mapping to/from a ``vision_config`` (MODELS.md 2.6).

One dataclass for both VL families: Qwen3.5 towers have no DeepStack (``deepstack_visual_indexes``
empty), Qwen3-VL-MoE towers list the blocks whose outputs feed the DeepStack mergers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hyperpar.errors import ConfigError
from hyperpar.models.hf_args import Entry, Fixed, Key, hf_entries, hf_fields

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _int_or_first(value: Any, name: str) -> int:
    """transformers allows ``patch_size`` / ``temporal_patch_size`` as an int or a list of equal ints."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"vision_config.{name}={list(value)}: only equal sizes are supported")
        value = value[0]
    return int(value)


# config.json entries in transformers' order; absent ones take its class defaults (the dataclass's).
VISION_KEYS: tuple[Entry, ...] = (
    Key("model_type", str),
    Key("depth", int, reads=("depth", "num_hidden_layers")),
    Key("hidden_size", int),
    Key("hidden_act", str),
    Key("intermediate_size", int),
    Key("num_heads", int, reads=("num_heads", "num_attention_heads")),
    Key("in_channels", int),
    Key("patch_size", lambda v: _int_or_first(v, "patch_size")),
    Key("spatial_merge_size", int),
    Key("temporal_patch_size", lambda v: _int_or_first(v, "temporal_patch_size")),
    Key("out_hidden_size", int),
    Key("num_position_embeddings", int),
    Key("initializer_range", float),
    Fixed("rope_type", "axial", rope=True, checked=True),
    Key("rope_theta", float, rope=True),
    # Qwen3-VL-MoE's class default is [8, 16, 24]; Qwen3.5 vision configs have no such field.
    Key("deepstack_visual_indexes", list, derive=lambda f, d: [8, 16, 24] if "vl_moe" in f["model_type"] else [],
        write_if=lambda a: bool(a.deepstack_visual_indexes) or "vl_moe" in a.model_type),
)


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

    HF_KEYS: ClassVar[tuple[Entry, ...]] = VISION_KEYS

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
        return cls(**hf_fields(cls, d, "vision"))

    def to_hf_config(self) -> dict[str, Any]:
        return hf_entries(self)

    def replace(self, **changes: Any) -> "VisionArgs":
        return type(self)(**{**asdict(self), **changes})

