"""Qwen3-VL-MoE (vision-language): registers the ``qwen3_vl_moe`` ModelSpec."""

from __future__ import annotations

from hyperpar.models.qwen3_vl_moe.args import FLAVORS, Qwen3VLMoeArgs, Qwen3VLMoeTextArgs
from hyperpar.models.qwen3_vl_moe.model import (
    Qwen3VLMoeDecoderLayer,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeModel,
    Qwen3VLMoeTextModel,
)
from hyperpar.models.qwen3_vl_moe.state_dict import Qwen3VLMoeStateDictAdapter
from hyperpar.models.spec import ModelSpec, lazy, register_model


# The parallel plans are imported when called: they pull in distributed code that building or
# loading a model does not need.
SPEC = register_model(
    ModelSpec(
        name="qwen3_vl_moe",
        args_cls=Qwen3VLMoeArgs,
        flavors=FLAVORS,
        model_cls=Qwen3VLMoeForConditionalGeneration,
        parallelize=lazy("hyperpar.models.qwen3_vl_moe.parallelize:parallelize_qwen3_vl_moe"),
        tp_plan=lazy("hyperpar.models.qwen3_5.parallelize_vl:vl_tp_plan"),
        adapter=Qwen3VLMoeStateDictAdapter,
        hf_model_types=("qwen3_vl_moe",),
        default_data="vl_dummy",
    )
)

__all__ = [
    "FLAVORS",
    "SPEC",
    "Qwen3VLMoeArgs",
    "Qwen3VLMoeDecoderLayer",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3VLMoeModel",
    "Qwen3VLMoeStateDictAdapter",
    "Qwen3VLMoeTextArgs",
    "Qwen3VLMoeTextModel",
]
