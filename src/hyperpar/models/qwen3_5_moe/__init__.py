"""Qwen3.5-MoE: registers ``qwen3_5_moe`` (text; loads text and VL checkpoints, ignoring the vision
tower) and ``qwen3_5_moe_vl`` (vision-language, on the shared vision tower)."""

from __future__ import annotations

from hyperpar.models.qwen3_5_moe.args import FLAVORS, VL_FLAVORS, Qwen3_5MoeArgs, Qwen3_5MoeVLArgs
from hyperpar.models.qwen3_5_moe.model import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeMTP,
    Qwen3_5MoeTextModel,
    Qwen3_5MoeVLModel,
)
from hyperpar.models.qwen3_5_moe.state_dict import Qwen3_5MoeStateDictAdapter, Qwen3_5MoeVLStateDictAdapter
from hyperpar.models.spec import ModelSpec, lazy, register_model


# The parallel plans are imported when called: they pull in distributed code that building or
# loading a model does not need.
SPEC = register_model(
    ModelSpec(
        name="qwen3_5_moe",
        args_cls=Qwen3_5MoeArgs,
        flavors=FLAVORS,
        model_cls=Qwen3_5MoeForCausalLM,
        parallelize=lazy("hyperpar.models.qwen3_5_moe.parallelize:parallelize_qwen3_5_moe"),
        tp_plan=lazy("hyperpar.models.qwen3_5.parallelize:causal_lm_tp_plan"),
        adapter=Qwen3_5MoeStateDictAdapter,
        hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
        hf_architectures=("Qwen3_5MoeForCausalLM",),
        default_data="dummy",
    )
)

VL_SPEC = register_model(
    ModelSpec(
        name="qwen3_5_moe_vl",
        args_cls=Qwen3_5MoeVLArgs,
        flavors=VL_FLAVORS,
        model_cls=Qwen3_5MoeForConditionalGeneration,
        parallelize=lazy("hyperpar.models.qwen3_5_moe.parallelize:parallelize_qwen3_5_moe_vl"),
        tp_plan=lazy("hyperpar.models.qwen3_5.parallelize_vl:vl_tp_plan"),
        adapter=Qwen3_5MoeVLStateDictAdapter,
        hf_model_types=("qwen3_5_moe",),
        hf_architectures=("Qwen3_5MoeForConditionalGeneration",),
        default_data="vl_dummy",
    )
)

__all__ = [
    "FLAVORS",
    "SPEC",
    "VL_FLAVORS",
    "VL_SPEC",
    "Qwen3_5MoeArgs",
    "Qwen3_5MoeDecoderLayer",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeMTP",
    "Qwen3_5MoeStateDictAdapter",
    "Qwen3_5MoeTextModel",
    "Qwen3_5MoeVLArgs",
    "Qwen3_5MoeVLModel",
    "Qwen3_5MoeVLStateDictAdapter",
]
