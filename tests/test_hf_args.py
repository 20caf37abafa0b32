"""The config.json key tables (models/hf_args.py): names transformers knows, its defaults, round trips."""

from __future__ import annotations

import dataclasses

import pytest

from hyperpar.errors import ConfigError
from hyperpar.models.hf_args import Fixed, Key
from hyperpar.models.qwen3_5.args import FLAVORS as DENSE
from hyperpar.models.qwen3_5.args import VL_FLAVORS as DENSE_VL
from hyperpar.models.qwen3_5.args import Qwen3_5Args
from hyperpar.models.qwen3_5_moe.args import FLAVORS as MOE
from hyperpar.models.qwen3_5_moe.args import VL_FLAVORS as MOE_VL
from hyperpar.models.qwen3_5_moe.args import Qwen3_5MoeArgs
from hyperpar.models.qwen3_vl_moe.args import FLAVORS as VL_MOE
from hyperpar.models.qwen3_vl_moe.args import Qwen3VLMoeTextArgs
from hyperpar.models.vision import VisionArgs

transformers = pytest.importorskip("transformers")

ALL = [(f"{type(a).__name__}:{name}", a) for table in (DENSE, DENSE_VL, MOE, MOE_VL, VL_MOE) for name, a in table.items()]
# Entries transformers' classes do not have: ours, kept for inference engines (MTP depth).
OURS_ONLY = {"mtp_num_hidden_layers"}


def _classes(args):
    """The args classes inside ``args`` (itself, and its text and vision parts)."""
    out = [args]
    for part in ("text", "vision"):
        if hasattr(args, part):
            out.append(getattr(args, part))
    return out


@pytest.mark.parametrize("name,args", ALL, ids=[n for n, _ in ALL])
def test_every_flavour_round_trips(name: str, args) -> None:
    assert type(args).from_hf_config(args.to_hf_config()) == args


@pytest.mark.parametrize("name,args", ALL, ids=[n for n, _ in ALL])
def test_every_key_names_a_dataclass_field(name: str, args) -> None:
    # A misspelt field would only show when a config lacks the key (its default lookup fails).
    for part in _classes(args):
        fields = {f.name for f in dataclasses.fields(part)}
        bad = [k.field for k in type(part).HF_KEYS if isinstance(k, Key) and k.field not in fields]
        assert not bad, f"{type(part).__name__}: {bad}"


@pytest.mark.parametrize("ours,theirs", [
    (DENSE["debug"], "Qwen3_5TextConfig"), (MOE["debug"], "Qwen3_5MoeTextConfig"), (DENSE_VL["debug"], "Qwen3_5Config"),
    (MOE_VL["debug"], "Qwen3_5MoeConfig"), (VL_MOE["debug"], "Qwen3VLMoeConfig"),
])
def test_written_names_are_transformers_names(ours, theirs: str) -> None:
    written, known = ours.to_hf_config(), getattr(transformers, theirs)().to_dict()
    for part in (None, "text_config", "vision_config"):
        w, k = (written, known) if part is None else (written.get(part), known.get(part))
        if w is None:
            continue
        assert set(w) - set(k) <= OURS_ONLY, (part, set(w) - set(k))


@pytest.mark.parametrize("cls,theirs,bare", [
    (Qwen3_5Args, "Qwen3_5TextConfig", {"model_type": "qwen3_5_text"}),
    (Qwen3_5MoeArgs, "Qwen3_5MoeTextConfig", {"model_type": "qwen3_5_moe_text"}),
    (Qwen3VLMoeTextArgs, "Qwen3VLMoeTextConfig", {}),
    (VisionArgs, "Qwen3VLMoeVisionConfig", {"model_type": "qwen3_vl_moe_vision"}),
])
def test_absent_keys_take_transformers_defaults(cls, theirs: str, bare: dict) -> None:
    full = getattr(transformers, theirs)().to_dict()
    assert cls.from_hf_config(bare) == cls.from_hf_config(full)


def test_fixed_entries_are_written_and_checked() -> None:
    cfg = DENSE["debug"].to_hf_config()
    assert cfg["rope_parameters"]["rope_type"] == "default" and cfg["attention_dropout"] == 0.0
    fixed = [k for k in Qwen3_5Args.HF_KEYS if isinstance(k, Fixed) and k.checked]
    assert {k.name for k in fixed} == {"rope_type", "attention_dropout"}
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        Qwen3_5Args.from_hf_config({**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "yarn"}})
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):  # the legacy name too
        Qwen3_5Args.from_hf_config({**cfg, "rope_parameters": None, "rope_scaling": {"type": "yarn"}})
    with pytest.raises(ConfigError, match="attention_dropout 0.1 is not supported"):
        Qwen3_5Args.from_hf_config({**cfg, "attention_dropout": 0.1})
    assert Qwen3_5Args.from_hf_config({**cfg, "attention_dropout": None}) == DENSE["debug"]


@pytest.mark.parametrize("family", ["moe", "moe_vl", "vl_moe"])
def test_norm_topk_prob_false_is_ignored_as_transformers_does(family: str, hyperpar_log) -> None:
    """transformers' Qwen3.5-MoE and Qwen3-VL-MoE always renormalise the top-k weights and ignore the key; we read
    it and skipped the renormalisation, so such a checkpoint's logits differed from transformers' by ~5e-2."""
    args = {"moe": MOE, "moe_vl": MOE_VL, "vl_moe": VL_MOE}[family]
    args = next(iter(args.values()))
    config = args.to_hf_config()
    text = config.get("text_config", config)
    assert "norm_topk_prob" not in text  # not written: transformers' classes have no such field
    text["norm_topk_prob"] = False
    assert type(args).from_hf_config(config) == args
    assert any("norm_topk_prob=false is ignored" in line for line in hyperpar_log)
