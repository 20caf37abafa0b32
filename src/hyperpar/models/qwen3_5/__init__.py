"""Qwen3.5 dense: registers ``qwen3_5`` (text; ``model.text_only=true`` reads the text model of a VL
checkpoint) and ``qwen3_5_vl`` (vision-language, on the shared vision tower)."""

from __future__ import annotations

from hyperpar.models.qwen3_5.args import FLAVORS, VL_FLAVORS, Qwen3_5Args, Qwen3_5VLArgs
from hyperpar.models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter
from hyperpar.models.qwen3_5.vl import Qwen3_5ForConditionalGeneration, Qwen3_5VLModel
from hyperpar.models.qwen3_5.vl_state_dict import Qwen3_5VLStateDictAdapter
from hyperpar.models.spec import ModelSpec, lazy, register_model


# The parallel plans are imported when called: they pull in distributed code that building or
# loading a model does not need.
SPEC = register_model(
    ModelSpec(
        name="qwen3_5",
        args_cls=Qwen3_5Args,
        flavors=FLAVORS,
        model_cls=Qwen3_5ForCausalLM,
        parallelize=lazy("hyperpar.models.qwen3_5.parallelize:parallelize_qwen3_5"),
        tp_plan=lazy("hyperpar.models.qwen3_5.parallelize:causal_lm_tp_plan"),
        adapter=Qwen3_5StateDictAdapter,
        hf_model_types=("qwen3_5_text", "qwen3_5"),
        hf_architectures=("Qwen3_5ForCausalLM",),
    )
)

VL_SPEC = register_model(
    ModelSpec(
        name="qwen3_5_vl",
        args_cls=Qwen3_5VLArgs,
        flavors=VL_FLAVORS,
        model_cls=Qwen3_5ForConditionalGeneration,
        parallelize=lazy("hyperpar.models.qwen3_5.parallelize_vl:parallelize_qwen3_5_vl"),
        tp_plan=lazy("hyperpar.models.qwen3_5.parallelize_vl:vl_tp_plan"),
        adapter=Qwen3_5VLStateDictAdapter,
        hf_model_types=("qwen3_5",),
        hf_architectures=("Qwen3_5ForConditionalGeneration",),
        default_data="vl_dummy",
    )
)

__all__ = [
    "FLAVORS",
    "SPEC",
    "VL_FLAVORS",
    "VL_SPEC",
    "Qwen3_5Args",
    "Qwen3_5DecoderLayer",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5StateDictAdapter",
    "Qwen3_5VLArgs",
    "Qwen3_5VLModel",
    "Qwen3_5VLStateDictAdapter",
]
