"""Qwen3.5-MoE: registers ``qwen3_5_moe`` (text; loads text and VL checkpoints, ignoring the vision
tower) and ``qwen3_5_moe_vl`` (vision-language, on the shared vision tower)."""

from __future__ import annotations

from typing import Any

from torch import nn

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
from hyperpar.models.spec import ModelSpec, register_model


def _parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    # Imported on call: distributed code that building or loading a model does not need.
    from hyperpar.models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe

    return parallelize_qwen3_5_moe(model, *args, **kwargs)


def _parallelize_vl(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    from hyperpar.models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe_vl

    return parallelize_qwen3_5_moe_vl(model, *args, **kwargs)


SPEC = register_model(
    ModelSpec(
        name="qwen3_5_moe",
        args_cls=Qwen3_5MoeArgs,
        flavors=FLAVORS,
        model_cls=Qwen3_5MoeForCausalLM,
        parallelize=_parallelize,
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
        parallelize=_parallelize_vl,
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
