"""Qwen3-VL-MoE geometry and its mapping to/from a Hugging Face config.json (MODELS.md 2.5–2.7)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hyperpar.errors import ConfigError
from hyperpar.models.hf_args import VL_KEYS, Entry, Fixed, Key, hf_entries, hf_fields, note_router_renormalises
from hyperpar.models.vision import VisionArgs


# config.json entries of the text part in transformers' order; absent ones take its class defaults
# (the dataclass defaults but for rope_theta and the head geometry, which follows the width).
TEXT_KEYS: tuple[Entry, ...] = (
    Fixed("model_type", "qwen3_vl_moe_text"),
    Key("vocab_size", int),
    Key("hidden_size", int),
    Key("intermediate_size", int),
    Key("num_hidden_layers", int),
    Key("num_attention_heads", int),
    Key("num_key_value_heads", int, or_default=True, derive=lambda f, d: f["num_attention_heads"]),
    Key("head_dim", int, or_default=True, derive=lambda f, d: f["hidden_size"] // f["num_attention_heads"]),
    Key("hidden_act", str),
    Key("rms_norm_eps", float),
    Fixed("rope_type", "default", rope=True, checked=True, reads=("rope_type", "type")),
    Key("rope_theta", float, default=500000.0, rope=True),
    Key("mrope_section", list, rope=True, or_default=True),
    Fixed("mrope_interleaved", True, rope=True),
    Key("num_experts", int, name="num_local_experts", reads=("num_experts", "num_local_experts")),  # saved under the alias
    Key("num_experts_per_tok", int),
    Key("moe_intermediate_size", int),
    Key("decoder_sparse_step", int),
    Key("mlp_only_layers", list, or_default=True),
    Key("router_aux_loss_coef", float),
    Fixed("output_router_logits", False),
    Key("attention_bias", bool),
    Fixed("attention_dropout", 0.0, checked=True),
    Key("max_position_embeddings", int),
    Key("initializer_range", float),
    Key("tie_word_embeddings", bool),
    Key("pad_token_id"),
    Key("bos_token_id"),
    Key("eos_token_id"),
    Fixed("use_cache", True),
)


@dataclass
class Qwen3VLMoeTextArgs:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632  # dense (mlp_only_layers / off-grid) layers only
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    num_experts: int = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True  # the text config's own flag; the VL model ties by the top-level one
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    HF_KEYS: ClassVar[tuple[Entry, ...]] = TEXT_KEYS

    def __post_init__(self) -> None:
        self.mrope_section = [int(x) for x in self.mrope_section]
        self.mlp_only_layers = [int(x) for x in self.mlp_only_layers]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, hint: str | None = None) -> ConfigError:
            return ConfigError(f"qwen3_vl_moe: {msg}", hint=hint)

        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(f"num_attention_heads {self.num_attention_heads} not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise bad(f"head_dim {self.head_dim} must be even")
        if self.hidden_act != "silu":
            raise bad(f"hidden_act '{self.hidden_act}' is not supported", hint="Qwen3-VL-MoE uses silu")
        if len(self.mrope_section) != 3:
            raise bad(f"mrope_section must have 3 entries, got {self.mrope_section}")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})")
        if self.decoder_sparse_step <= 0:
            raise bad("decoder_sparse_step must be positive")

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: MoE iff not in mlp_only_layers, experts exist and (i+1) is on the sparse-step grid."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_hf_config(cls, t: dict[str, Any]) -> "Qwen3VLMoeTextArgs":
        note_router_renormalises(t, "Qwen3-VL-MoE")
        return cls(**hf_fields(cls, t, "qwen3_vl_moe"))

    def to_hf_config(self) -> dict[str, Any]:
        return hf_entries(self)


@dataclass
class Qwen3VLMoeArgs:
    text: Qwen3VLMoeTextArgs = field(default_factory=Qwen3VLMoeTextArgs)
    vision: VisionArgs = field(default_factory=lambda: VisionArgs(out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24]))
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False  # top-level flag: what Qwen3VLMoeForConditionalGeneration ties by

    HF_KEYS: ClassVar[tuple[Entry, ...]] = VL_KEYS

    def __post_init__(self) -> None:
        if isinstance(self.text, dict):
            self.text = Qwen3VLMoeTextArgs(**self.text)
        if isinstance(self.vision, dict):
            self.vision = VisionArgs(**self.vision)
        self.validate()

    def validate(self) -> None:
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ConfigError(
                f"qwen3_vl_moe: vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size {self.text.hidden_size}",
                hint="the merger must project to the text width",
            )
        ids = {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "vision_start_token_id": self.vision_start_token_id, "vision_end_token_id": self.vision_end_token_id}
        out = [f"{k}={v}" for k, v in ids.items() if not 0 <= v < self.text.vocab_size]
        if out:
            raise ConfigError(f"qwen3_vl_moe: {', '.join(out)} outside the vocabulary of {self.text.vocab_size}")
        if self.num_deepstack > self.text.num_hidden_layers:
            raise ConfigError(f"qwen3_vl_moe: {self.num_deepstack} DeepStack levels but only {self.text.num_hidden_layers} text layers")

    # Shortcuts the framework and the data read (vocab for DataContext, vision settings for VL data).
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "Qwen3VLMoeArgs":
        if not isinstance(d.get("text_config"), dict) or not isinstance(d.get("vision_config"), dict):
            raise ConfigError("qwen3_vl_moe config.json needs text_config and vision_config")
        return cls(
            text=Qwen3VLMoeTextArgs.from_hf_config(d["text_config"]),
            vision=VisionArgs.from_hf_config({"model_type": "qwen3_vl_moe_vision", **d["vision_config"]}),
            **hf_fields(cls, d, "qwen3_vl_moe"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``Qwen3VLMoeForConditionalGeneration`` config.json with every field explicit."""
        return {
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "model_type": "qwen3_vl_moe",
            "text_config": self.text.to_hf_config(),
            "vision_config": self.vision.to_hf_config(),
            **hf_entries(self),
        }

    def replace(self, **changes: Any) -> "Qwen3VLMoeArgs":
        return dataclasses.replace(self, **changes)


FLAVORS: dict[str, Qwen3VLMoeArgs] = {
    # CPU-fast: 4 full-attention layers (layer 2 dense, so both FFN kinds run), E 8 / k 2,
    # 2·Ie ≠ H so expert layout bugs cannot hide; a 3-block tower with DeepStack on blocks 0 and 2.
    "debug": Qwen3VLMoeArgs(
        text=Qwen3VLMoeTextArgs(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=5e6,
            mrope_section=[6, 5, 5],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        vision=VisionArgs(
            depth=3,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=8,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=128,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=2040,
        video_token_id=2041,
        vision_start_token_id=2042,
        vision_end_token_id=2043,
    ),
    # Qwen3-VL-30B-A3B (MODELS.md 2.7); read the checkpoint's config.json for real runs.
    "30b_a3b": Qwen3VLMoeArgs(
        text=Qwen3VLMoeTextArgs(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            rope_theta=5e6,
            mrope_section=[24, 20, 20],
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=262144,
            tie_word_embeddings=False,
        ),
        vision=VisionArgs(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
    ),
}

