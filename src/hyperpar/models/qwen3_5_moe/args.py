"""Qwen3.5-MoE text geometry (MODELS.md 2.1, 2.7, 11): the dense args plus experts and MTP."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hyperpar.errors import ConfigError
from hyperpar.models.hf_args import Entry, Fixed, Key, note_router_renormalises, replace_keys
from hyperpar.models.layers.moe import EXPERTS_IMPLS
from hyperpar.models.qwen3_5.args import FLAVORS as DENSE_FLAVORS
from hyperpar.models.qwen3_5.args import TEXT_KEYS, Qwen3_5Args, Qwen3_5VLArgs, released
from hyperpar.models.vision import VisionArgs

# The dense entries (intermediate_size is not one: every layer is MoE) and the experts'. Defaults are
# the dataclass's, which are transformers' Qwen3_5MoeTextConfig defaults.
MOE_TEXT_KEYS: tuple[Entry, ...] = replace_keys(TEXT_KEYS, drop=("intermediate_size",)) + (
    Key("num_experts", int),
    Key("num_experts_per_tok", int),
    Key("moe_intermediate_size", int),
    Key("shared_expert_intermediate_size", int),
    Key("router_aux_loss_coef", float),
    Fixed("output_router_logits", False),
    # not a transformers field; inference engines read it
    Key("mtp_num_hidden_layers", int, or_default=True, write_if=lambda a: a.mtp_num_hidden_layers > 0),
)


@dataclass
class Qwen3_5MoeArgs(Qwen3_5Args):
    # Dense fields keep their meaning; intermediate_size is unused (every layer is MoE).
    hidden_size: int = 2048
    intermediate_size: int = 0
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    # Multi-token prediction (MODELS.md 11): mtp.* modules are built when ≥ 1 (depth-1 prediction
    # uses mtp.layers.0; further layers are carried through load/export). mtp_loss_weight is a
    # training choice (model.mtp_loss_weight): mtp_logits are produced only when it is > 0.
    mtp_num_hidden_layers: int = 0
    mtp_loss_weight: float = 0.0
    experts_impl: str = "auto"  # grouped | loop | auto (not a checkpoint field)

    HF_MODEL_TYPE: ClassVar[str] = "qwen3_5_moe_text"
    HF_ARCHITECTURE: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    HF_KEYS: ClassVar[tuple[Entry, ...]] = MOE_TEXT_KEYS

    def validate(self) -> None:
        super().validate()

        def bad(msg: str, hint: str | None = None) -> ConfigError:
            return ConfigError(f"qwen3_5_moe: {msg}", hint=hint)

        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise bad(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise bad("moe_intermediate_size must be ≥ 1 and shared_expert_intermediate_size ≥ 0")
        if self.mtp_num_hidden_layers < 0 or self.mtp_loss_weight < 0:
            raise bad("mtp_num_hidden_layers and mtp_loss_weight must be ≥ 0")
        if self.mtp_loss_weight > 0 and self.mtp_num_hidden_layers < 1:
            raise bad(
                f"mtp_loss_weight={self.mtp_loss_weight} but the model has no MTP module",
                hint="set mtp_num_hidden_layers ≥ 1 (a checkpoint with mtp.* weights has it) or model.mtp_loss_weight=0",
            )
        if self.experts_impl not in EXPERTS_IMPLS:
            raise bad(f"experts_impl '{self.experts_impl}' is not one of {', '.join(EXPERTS_IMPLS)}")

    @property
    def mtp_enabled(self) -> bool:
        return self.mtp_num_hidden_layers > 0 and self.mtp_loss_weight > 0

    @classmethod
    def text_config(cls, d: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
        """A composite config's text part; ``mtp_num_hidden_layers`` may sit in either level."""
        note_router_renormalises(text, "Qwen3.5-MoE")
        if "mtp_num_hidden_layers" not in text and "mtp_num_hidden_layers" in d:
            return {**text, "mtp_num_hidden_layers": d["mtp_num_hidden_layers"]}
        return text


def _moe(dense: Qwen3_5Args, **moe: Any) -> Qwen3_5MoeArgs:
    """A dense geometry with MoE FFNs in every layer (the dense ``intermediate_size`` goes)."""
    return Qwen3_5MoeArgs(**{**asdict(dense), "intermediate_size": 0, **moe})


FLAVORS: dict[str, Qwen3_5MoeArgs] = {
    # ~2.3M parameters, CPU-fast: the dense debug geometry (both layer types in each half, dk ≠ dv,
    # nv = 2·nk) with E 8 / k 2, Ie ≠ Is ≠ H, one MTP layer (trained only with model.mtp_loss_weight > 0).
    "debug": _moe(DENSE_FLAVORS["debug"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                  shared_expert_intermediate_size=64, mtp_num_hidden_layers=1),
    # Qwen3.5-35B-A3B (MODELS.md 2.7; read the checkpoint's config.json for the authoritative values).
    "35b_a3b": _moe(released(2048, 40, 16, 2, 0, 32, tied=False), num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, mtp_num_hidden_layers=1),
}


# --- vision-language (Qwen3_5MoeForConditionalGeneration, MODELS.md 2.4, 2.6, 8, 9) ----------------


def _vision_35b() -> VisionArgs:
    return VisionArgs(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                      num_position_embeddings=2304, deepstack_visual_indexes=[], model_type="qwen3_5_moe_vision")


@dataclass
class Qwen3_5MoeVLArgs(Qwen3_5VLArgs):
    """The composite config: the MoE text model, the (DeepStack-free) vision tower, special token ids
    (the dense VL args with MoE text and names).

    Tying follows the top-level flag (copied into ``text.tie_word_embeddings``). ``mtp_loss_weight``
    lives here (ModelBuilder sets it); ``text.mtp_loss_weight`` is not used by the VL model.
    """

    text: Qwen3_5MoeArgs = field(default_factory=lambda: FLAVORS["35b_a3b"])
    vision: VisionArgs = field(default_factory=_vision_35b)
    mtp_loss_weight: float = 0.0

    NAME: ClassVar[str] = "qwen3_5_moe_vl"
    TEXT_CLS: ClassVar[type] = Qwen3_5MoeArgs
    HF_MODEL_TYPE: ClassVar[str] = "qwen3_5_moe"
    HF_ARCHITECTURE: ClassVar[str] = "Qwen3_5MoeForConditionalGeneration"
    VISION_MODEL_TYPE: ClassVar[str] = "qwen3_5_moe_vision"

    def validate(self) -> None:
        super().validate()
        if self.mtp_loss_weight < 0:
            raise self.error("mtp_loss_weight must be ≥ 0")
        if self.mtp_loss_weight > 0 and self.text.mtp_num_hidden_layers < 1:
            raise self.error(f"mtp_loss_weight={self.mtp_loss_weight} but the model has no MTP module",
                             hint="set text mtp_num_hidden_layers ≥ 1 or model.mtp_loss_weight=0")

    @property
    def text_for_mtp(self) -> Qwen3_5MoeArgs:
        """The text args with this model's MTP weight (what the FLOP count needs)."""
        return self.text.replace(mtp_loss_weight=self.mtp_loss_weight)


VL_FLAVORS: dict[str, Qwen3_5MoeVLArgs] = {
    # The debug text model + a 2-block tower (8-pixel patches keep the dummy images small).
    "debug": Qwen3_5MoeVLArgs(
        text=FLAVORS["debug"],
        vision=VisionArgs(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                          num_position_embeddings=64, deepstack_visual_indexes=[], model_type="qwen3_5_moe_vision"),
        image_token_id=2040,
        video_token_id=2041,
        vision_start_token_id=2042,
        vision_end_token_id=2043,
    ),
    # Qwen3.5-35B-A3B with its vision tower (MODELS.md 2.7).
    "35b_a3b": Qwen3_5MoeVLArgs(),
}
