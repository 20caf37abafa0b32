"""Qwen3.5 dense (text): registers the ``qwen3_5`` ModelSpec."""

from __future__ import annotations

from typing import Any

from torch import nn

from hyperpar.models.qwen3_5.args import FLAVORS, Qwen3_5Args
from hyperpar.models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM
from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter
from hyperpar.models.spec import ModelSpec, register_model


def _parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    # Imported on call: the parallel plan lives in its own module and pulls in distributed code
    # that building or loading a model does not need.
    from hyperpar.models.qwen3_5.parallelize import parallelize_qwen3_5

    return parallelize_qwen3_5(model, *args, **kwargs)


SPEC = register_model(
    ModelSpec(
        name="qwen3_5",
        args_cls=Qwen3_5Args,
        flavors=FLAVORS,
        model_cls=Qwen3_5ForCausalLM,
        parallelize=_parallelize,
        adapter=Qwen3_5StateDictAdapter,
        hf_model_types=("qwen3_5_text", "qwen3_5"),
        hf_architectures=("Qwen3_5ForCausalLM",),
    )
)

__all__ = ["FLAVORS", "SPEC", "Qwen3_5Args", "Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM", "Qwen3_5StateDictAdapter"]
