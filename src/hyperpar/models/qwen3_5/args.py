"""Qwen3.5 dense geometry and its mapping to/from a Hugging Face config.json (MODELS.md 2)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hyperpar.errors import ConfigError
from hyperpar.models.hf_args import VL_KEYS, Entry, Fixed, Key, hf_entries, hf_fields
from hyperpar.models.vision.args import VisionArgs

LINEAR = "linear_attention"
FULL = "full_attention"


def interval_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """transformers' expansion of ``full_attention_interval``: layer i is full iff (i+1) % interval == 0."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


# config.json entries in transformers' order; absent ones take its class defaults (MODELS.md 2).
TEXT_KEYS: tuple[Entry, ...] = (
    Key("vocab_size", int),
    Key("hidden_size", int),
    Key("intermediate_size", int),
    Key("num_hidden_layers", int),
    Key("num_attention_heads", int),
    Key("num_key_value_heads", int),
    Key("head_dim", int, or_default=True),
    Key("hidden_act", str),
    Key("rms_norm_eps", float),
    Key("layer_types", list, or_default=True, derive=lambda f, d: interval_layer_types(
        f["num_hidden_layers"], int(d.get("full_attention_interval", 4)))),
    Key("linear_conv_kernel_dim", int),
    Key("linear_key_head_dim", int),
    Key("linear_value_head_dim", int),
    Key("linear_num_key_heads", int),
    Key("linear_num_value_heads", int),
    Fixed("rope_type", "default", rope=True, checked=True, reads=("rope_type", "type")),
    Key("rope_theta", float, default=10000.0, rope=True),
    Key("partial_rotary_factor", float, rope=True),
    Key("mrope_section", list, rope=True, or_default=True),
    Fixed("mrope_interleaved", True, rope=True),
    Key("tie_word_embeddings", bool),
    Key("attention_bias", bool),
    Fixed("attention_dropout", 0.0, checked=True),
    Key("max_position_embeddings", int),
    Key("initializer_range", float),
    Key("pad_token_id"),
    Key("bos_token_id"),
    Key("eos_token_id"),
    Fixed("use_cache", True),
)


@dataclass
class Qwen3_5Args:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    layer_types: list[str] = field(default_factory=list)  # empty → every 4th layer full
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = interval_layer_types(self.num_hidden_layers)
        self.layer_types = list(self.layer_types)
        self.mrope_section = list(self.mrope_section)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, hint: str | None = None) -> ConfigError:
            return ConfigError(f"qwen3_5: {msg}", hint=hint)

        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise bad(f"unknown layer types {unknown}", hint=f"use '{LINEAR}' or '{FULL}'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(f"num_attention_heads {self.num_attention_heads} not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad(f"linear_num_value_heads {self.linear_num_value_heads} not a multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if self.hidden_act != "silu":
            raise bad(f"hidden_act '{self.hidden_act}' is not supported", hint="Qwen3.5 uses silu")
        rot = self.rotary_dim
        if rot <= 0 or rot % 2 or rot > self.head_dim:
            raise bad(f"rotary dim int(head_dim·partial_rotary_factor) = {rot} must be even and in (0, head_dim]")
        if len(self.mrope_section) != 3:
            raise bad(f"mrope_section must have 3 entries, got {self.mrope_section}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    # --- Hugging Face config.json --------------------------------------------------------------

    HF_MODEL_TYPE: ClassVar[str] = "qwen3_5_text"
    HF_ARCHITECTURE: ClassVar[str] = "Qwen3_5ForCausalLM"
    HF_KEYS: ClassVar[tuple[Entry, ...]] = TEXT_KEYS

    @staticmethod
    def split_composite(d: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(text config, tie_word_embeddings) of a text config or a composite (VL) config.

        A composite config ties by its top-level flag (the ForConditionalGeneration class's rule,
        MODELS.md 2.4); a text config by its own.
        """
        if "text_config" in d:
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError(f"{d.get('model_type', 'composite')} config.json has no text_config")
            text = d["text_config"]
            return text, bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return d, bool(d.get("tie_word_embeddings", False))

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "Qwen3_5Args":
        """From a ``qwen3_5_text`` config or a composite ``qwen3_5`` (VL) config with ``text_config``.

        Absent fields take transformers' class defaults (not the released values), except that
        tying follows the checkpoint's own class: a composite config ties by its top-level flag.
        """
        composite = cls.HF_MODEL_TYPE.removesuffix("_text")
        if d.get("model_type") == composite and "text_config" not in d:
            raise ConfigError(f"{composite} composite config.json has no text_config")
        text, tie = cls.split_composite(d)
        return cls(**{**hf_fields(cls, cls.text_config(d, text), "qwen3_5"), "tie_word_embeddings": tie})

    @classmethod
    def text_config(cls, d: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
        """The text part to read (a family may complete it from the composite level)."""
        return text

    def to_hf_config(self) -> dict[str, Any]:
        """A text-only (``*ForCausalLM``) config.json with every field explicit."""
        return {"architectures": [self.HF_ARCHITECTURE], "model_type": self.HF_MODEL_TYPE, **hf_entries(self)}

    def replace(self, **changes: Any) -> "Qwen3_5Args":
        return type(self)(**{**asdict(self), **changes})


def released(hidden: int, layers: int, nh: int, nkv: int, inter: int, nv: int, tied: bool) -> Qwen3_5Args:
    """A released geometry (MODELS.md 2.7): what all released sizes share, MoE ones too, and their own sizes."""
    return Qwen3_5Args(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=256,
        layer_types=interval_layer_types(layers, 4),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=nv,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        tie_word_embeddings=tied,
        max_position_embeddings=262144,
    )


FLAVORS: dict[str, Qwen3_5Args] = {
    # ~1.6M parameters, both layer types in each half (a 2-stage pipeline split keeps both kinds),
    # dk ≠ dv and nv = 2·nk so layout and head-repeat bugs cannot hide.
    "debug": Qwen3_5Args(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=[LINEAR, FULL, LINEAR, FULL],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[3, 3, 2],
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "0.8b": released(1024, 24, 8, 2, 3584, 16, tied=True),
    "4b": released(2560, 32, 16, 4, 9216, 32, tied=True),
    "9b": released(4096, 32, 16, 4, 12288, 32, tied=False),
    "27b": released(5120, 64, 24, 4, 17408, 48, tied=False),
}


# --- vision-language (Qwen3_5ForConditionalGeneration, MODELS.md 2.4, 2.6, 8, 9) -----------------


def _vision(depth: int, hidden: int, heads: int, inter: int, out: int) -> VisionArgs:
    # MODELS.md 2.7: patch 16, temporal patch 2, merge 2, 48×48 learned positions in every release.
    return VisionArgs(depth=depth, hidden_size=hidden, intermediate_size=inter, num_heads=heads, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=out,
                      num_position_embeddings=2304, deepstack_visual_indexes=[], model_type="qwen3_5_vision")


@dataclass
class Qwen3_5VLArgs:
    """The composite ``qwen3_5`` config: the dense text model, the (DeepStack-free) vision tower and
    the special token ids. Tying follows the top-level flag (copied into ``text.tie_word_embeddings``,
    the ForConditionalGeneration class's rule, MODELS.md 2.4). A MoE family subclasses it with its
    own text args class and names."""

    text: Qwen3_5Args = field(default_factory=Qwen3_5Args)
    vision: VisionArgs = field(default_factory=lambda: _vision(27, 1152, 16, 4304, 4096))
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False

    NAME: ClassVar[str] = "qwen3_5_vl"
    TEXT_CLS: ClassVar[type] = Qwen3_5Args
    HF_MODEL_TYPE: ClassVar[str] = "qwen3_5"
    HF_ARCHITECTURE: ClassVar[str] = "Qwen3_5ForConditionalGeneration"
    VISION_MODEL_TYPE: ClassVar[str] = "qwen3_5_vision"
    HF_KEYS: ClassVar[tuple[Entry, ...]] = VL_KEYS

    def __post_init__(self) -> None:
        if isinstance(self.text, dict):
            self.text = self.TEXT_CLS(**self.text)
        if isinstance(self.vision, dict):
            self.vision = VisionArgs(**self.vision)
        if self.text.tie_word_embeddings != self.tie_word_embeddings:
            self.text = self.text.replace(tie_word_embeddings=self.tie_word_embeddings)
        self.validate()

    def error(self, msg: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.NAME}: {msg}", hint=hint)

    def validate(self) -> None:
        bad = self.error
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise bad(f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size {self.text.hidden_size}",
                      hint="the merger must project to the text width")
        if self.vision.deepstack_visual_indexes:
            raise bad("Qwen3.5 vision towers have no DeepStack mergers", hint="deepstack_visual_indexes must be empty")
        ids = {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "vision_start_token_id": self.vision_start_token_id, "vision_end_token_id": self.vision_end_token_id}
        out = [f"{k}={v}" for k, v in ids.items() if not 0 <= v < self.text.vocab_size]
        if out:
            raise bad(f"{', '.join(out)} outside the vocabulary of {self.text.vocab_size}")

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "Qwen3_5VLArgs":
        if not isinstance(d.get("text_config"), dict) or not isinstance(d.get("vision_config"), dict):
            raise ConfigError(f"{cls.HF_MODEL_TYPE} config.json needs text_config and vision_config for the VL model",
                              hint=f"a text-only {cls.TEXT_CLS.HF_MODEL_TYPE} directory loads with the text model group")
        return cls(
            text=cls.TEXT_CLS.from_hf_config(d),  # reads text_config; ties by the top-level flag
            vision=VisionArgs.from_hf_config({"model_type": cls.VISION_MODEL_TYPE, **d["vision_config"]}),
            **hf_fields(cls, d, cls.NAME),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``*ForConditionalGeneration`` config.json with every field explicit."""
        text = self.text.to_hf_config()
        del text["architectures"]
        return {
            "architectures": [self.HF_ARCHITECTURE],
            "model_type": self.HF_MODEL_TYPE,
            "text_config": text,
            "vision_config": self.vision.to_hf_config(),
            **hf_entries(self),
        }

    def replace(self, **changes: Any) -> "Qwen3_5VLArgs":
        return dataclasses.replace(self, **changes)


def _vl(text: str, vision: VisionArgs) -> Qwen3_5VLArgs:
    t = FLAVORS[text]
    return Qwen3_5VLArgs(text=t, vision=vision, tie_word_embeddings=t.tie_word_embeddings)


VL_FLAVORS: dict[str, Qwen3_5VLArgs] = {
    # The debug text model + a 2-block tower (8-pixel patches keep the dummy images small); the special
    # ids sit at the top of the 2048-token vocabulary.
    "debug": Qwen3_5VLArgs(
        text=FLAVORS["debug"],
        vision=VisionArgs(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                          num_position_embeddings=64, deepstack_visual_indexes=[], model_type="qwen3_5_vision"),
        image_token_id=2040,
        video_token_id=2041,
        vision_start_token_id=2042,
        vision_end_token_id=2043,
    ),
    # The released sizes with their towers (MODELS.md 2.7; read the checkpoint's config.json).
    "0.8b": _vl("0.8b", _vision(12, 768, 12, 3072, 1024)),
    "4b": _vl("4b", _vision(24, 1024, 16, 4096, 2560)),
    "9b": _vl("9b", _vision(27, 1152, 16, 4304, 4096)),
    "27b": _vl("27b", _vision(27, 1152, 16, 4304, 5120)),
}
