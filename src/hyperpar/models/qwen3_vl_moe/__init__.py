"""Qwen3-VL-MoE (vision-language): registers the ``qwen3_vl_moe`` ModelSpec."""

from __future__ import annotations

from typing import Any

from torch import nn

from hyperpar.models.qwen3_vl_moe.args import FLAVORS, Qwen3VLMoeArgs, Qwen3VLMoeTextArgs
from hyperpar.models.qwen3_vl_moe.model import (
    Qwen3VLMoeDecoderLayer,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeModel,
    Qwen3VLMoeTextModel,
)
from hyperpar.models.qwen3_vl_moe.state_dict import Qwen3VLMoeStateDictAdapter
from hyperpar.models.spec import ModelSpec, register_model


def _parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    # Imported on call: the parallel plan pulls in distributed code that building a model does not need.
    from hyperpar.models.qwen3_vl_moe.parallelize import parallelize_qwen3_vl_moe

    return parallelize_qwen3_vl_moe(model, *args, **kwargs)


SPEC = register_model(
    ModelSpec(
        name="qwen3_vl_moe",
        args_cls=Qwen3VLMoeArgs,
        flavors=FLAVORS,
        model_cls=Qwen3VLMoeForConditionalGeneration,
        parallelize=_parallelize,
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
