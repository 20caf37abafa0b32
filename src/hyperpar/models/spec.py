"""ModelSpec: what the framework needs to know about a model family, and the registry of them.

A model family registers one spec from its package ``__init__``. The worker builds the model on
the meta device from ``args``, lets ``parallelize`` cut it, then materialises parameters with
``Model.init_param`` (a pure function of seed and parameter name, so any layout gets the same
initial weights) or loads them through ``adapter``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from hyperpar.errors import ConfigError


class StateDictAdapter(Protocol):
    """Maps one of our parameters to and from a Hugging Face checkpoint, one tensor at a time.

    Working per parameter lets every rank read only what it needs and never hold the full model.
    """

    def load_param(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Full tensor for our parameter ``name``; ``read(hf_key)`` returns one checkpoint tensor."""
        ...

    def export_param(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF keys and tensors for our full parameter (empty for a tied ``lm_head.weight``)."""
        ...

    def hf_config(self) -> dict[str, Any]:
        """The config.json that transformers loads for this geometry."""
        ...


@dataclass
class ModelSpec:
    name: str
    args_cls: type  # dataclass; ``from_hf_config(dict)`` and ``to_hf_config()``
    flavors: dict[str, Any]  # flavour name -> args instance
    model_cls: Callable[[Any], nn.Module]  # model_cls(args) -> module (build under torch.device("meta"))
    parallelize: Callable[..., nn.Module]  # parallelize(model, parallel_dims, job_cfg) -> model
    adapter: Callable[[Any], StateDictAdapter]  # adapter(args) -> StateDictAdapter
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type" values this family loads
    # config.json "architectures" this family is the natural reader of (picks between families
    # that load the same model_type)
    hf_architectures: tuple[str, ...] = ()
    default_data: str = "dummy"  # data config a bare `model=<name>` trains on
    # tp_plan(model, parallel_dims, train_cfg) -> {module path: ParallelStyle}: the tensor-parallel
    # cut that ``parallelize`` applies, readable without a mesh (the planner's memory per rank)
    tp_plan: Callable[..., dict] | None = None

    def args_for(self, flavor: str) -> Any:
        if flavor not in self.flavors:
            known = ", ".join(sorted(self.flavors))
            raise ConfigError(
                f"unknown flavour '{flavor}' for model '{self.name}'",
                hint=f"known flavours: {known}",
            )
        return self.flavors[flavor]


def lazy(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` as a callable that imports the module when first called: a
    family's parallel plan pulls in distributed code that building or loading a model does not need."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = name
    return call


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"model '{spec.name}' registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _load_builtin() -> None:
    # Importing the family packages registers their specs.
    import hyperpar.models.qwen3_5  # noqa: F401
    import hyperpar.models.qwen3_5_moe  # noqa: F401
    import hyperpar.models.qwen3_vl_moe  # noqa: F401


def get_model_spec(name: str) -> ModelSpec:
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model '{name}'", hint=f"known models: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    _load_builtin()
    for spec in _REGISTRY.values():
        if model_type in spec.hf_model_types:
            return spec
    known = sorted(t for s in _REGISTRY.values() for t in s.hf_model_types)
    raise ConfigError(f"config.json model_type '{model_type}' is not supported", hint=f"supported: {', '.join(known)}")


def spec_for_hf_config(config: dict[str, Any]) -> ModelSpec:
    """The family for a config.json: by ``model_type``; when several families load that type (a text
    family also reads its VL checkpoints), the one whose ``hf_architectures`` lists the config's
    architecture wins, else the first registered."""
    model_type = str(config.get("model_type", ""))
    _load_builtin()
    candidates = [s for s in _REGISTRY.values() if model_type in s.hf_model_types]
    archs = set(config.get("architectures") or [])
    for spec in candidates:
        if archs & set(spec.hf_architectures):
            return spec
    return candidates[0] if candidates else spec_for_hf_model_type(model_type)


def spec_of_model(model: nn.Module) -> ModelSpec:
    """The family that builds ``model``: the most derived registered class wins, since one family may
    subclass another's model (Qwen3.5-MoE's is a Qwen3.5 dense model with another FFN)."""
    _load_builtin()
    mro = type(model).__mro__
    best: tuple[int, ModelSpec] | None = None
    for spec in _REGISTRY.values():
        cls = spec.model_cls
        if isinstance(cls, type) and cls in mro and (best is None or mro.index(cls) < best[0]):
            best = (mro.index(cls), spec)
    if best is None:
        from hyperpar.errors import CheckpointError

        raise CheckpointError(f"no registered model family builds {type(model).__name__}")
    return best[1]


def registered_models() -> dict[str, ModelSpec]:
    _load_builtin()
    return dict(_REGISTRY)
