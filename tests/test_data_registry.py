"""The data registry: names, errors, every data config composing, megatron through the registry, and
1-process vs 2-process parity for every real-data type through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import compose_cfg, read_losses, run_cli
from hyperpar.data.registry import DataContext, available, build_dataset, register_dataset
from hyperpar.errors import ConfigError, DataError

TOKENIZER = "pkg://hyperpar.data/corpus/tokenizer"


def test_registering_a_name_twice_is_an_error():
    available()  # loads the built-in types
    with pytest.raises(ValueError, match="data type 'dummy' registered twice"):
        register_dataset("dummy")(lambda options, ctx: None)


def test_builtin_types_are_registered():
    assert {"dummy", "hf", "json", "preset", "megatron"} <= set(available())


def test_unknown_type_lists_the_available_ones():
    ctx = DataContext(seq_len=8, seed=0, num_samples=1, vocab_size=2048)
    with pytest.raises(ConfigError) as e:
        build_dataset("nope", context=ctx)
    assert "unknown data.type 'nope'" in str(e.value) and "json, megatron, preset" in e.value.hint


def test_unknown_type_on_the_cli_is_one_line(tmp_path):
    res = run_cli(["data.type=nope", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=300)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "unknown data.type 'nope'" in lines[0] and "available: dummy, hf, json, megatron, preset" in lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides", [
    ["data=json"],
    ["data=hf", "data.path=/d/x.parquet", f"data.tokenizer={TOKENIZER}", "data.split='train[:10]'", "data.max_samples=5"],
    ["data=preset", "data.path=/d/b.safetensors", "data.extra.labels_shifted=false"],
    ["data=megatron", "data.prefix=/d/wiki", "data.extra.split='969,30,1'", "data.extra.eod_mask_loss=true"],
    ["data=megatron", "data.blend=[{weight:0.3,prefix:'/d/a'},{weight:0.7,prefix:'/d/b'}]"],
], ids=["json", "hf", "preset", "megatron", "megatron-blend-list"])
def test_data_configs_compose(overrides):
    cfg = compose_cfg(overrides)
    assert cfg.data.type == overrides[0].split("=")[1]
    assert cfg.data._target_ == "hyperpar.data.registry.build_dataset"


@pytest.fixture(scope="module")
def megatron_prefix(tmp_path_factory) -> str:
    """The packaged corpus as a Megatron .bin/.idx corpus (EOD after every document)."""
    from hyperpar.data.hf import resolve_path
    from hyperpar.data.megatron.convert import convert

    out = tmp_path_factory.mktemp("megatron") / "shakespeare"
    convert(resolve_path("pkg://hyperpar.data/corpus/shakespeare.jsonl"), resolve_path(TOKENIZER), str(out),
            append_eod=True, progress=False)
    return str(out)


def test_megatron_through_the_registry(megatron_prefix, tmp_path):
    from hyperpar.data.megatron import MegatronSource

    ctx = DataContext(seq_len=16, seed=5, num_samples=40, vocab_size=2048)
    src = build_dataset("megatron", context=ctx, prefix=megatron_prefix, cache_dir=str(tmp_path / "c"),
                        tokenizer=TOKENIZER, extra={"eod_mask_loss": True})
    assert len(src) == 40
    ref = MegatronSource(prefix=megatron_prefix, seq_len=16, num_samples=40, seed=5, eod_token_id=0,
                         eod_mask_loss=True, cache_dir=str(tmp_path / "c"))
    saw_eod = False
    for i in range(40):
        s = src[i]
        assert s["input_ids"].shape == s["labels"].shape == s["position_ids"].shape == (16,)
        assert torch.equal(s["input_ids"], ref[i]["input_ids"]) and torch.equal(s["labels"], ref[i]["labels"])
        keep = s["labels"][:-1] != -100
        assert torch.equal(s["labels"][:-1][keep], s["input_ids"][1:][keep])  # pre-shifted
        # eod_mask_loss (megatron's rule): no loss where the input is EOD (the tokenizer's eos, id 0)
        assert torch.equal(s["labels"] == -100, s["input_ids"] == 0)
        saw_eod |= bool((~keep).any())
    assert saw_eod
    # The two spellings of a blend give the same samples.
    as_string = build_dataset("megatron", context=ctx, blend=f"0.4 {megatron_prefix} 0.6 {megatron_prefix}",
                              cache_dir=str(tmp_path / "c"))
    as_list = build_dataset("megatron", context=ctx, blend=[{"weight": 0.4, "prefix": megatron_prefix},
                                                            {"weight": 0.6, "prefix": megatron_prefix}],
                            cache_dir=str(tmp_path / "c"))
    assert all(torch.equal(as_string[i]["input_ids"], as_list[i]["input_ids"]) for i in range(40))
    with pytest.raises(DataError, match="exactly one of data.prefix or data.blend"):
        build_dataset("megatron", context=ctx)
    with pytest.raises(DataError, match="needs the EOD token id"):
        build_dataset("megatron", context=ctx, prefix=megatron_prefix, extra={"reset_position_ids": True})
    with pytest.raises(DataError, match="data.split='969,30,1' is not one of"):
        build_dataset("megatron", context=ctx, prefix=megatron_prefix, split="969,30,1")


# -- parity: 1 process vs FSDP over 2 processes, per step, fp32 -------------------------------------

def _hf_dataset(root: Path) -> list[str]:
    import datasets

    from hyperpar.data.hf import resolve_path

    lines = Path(resolve_path("pkg://hyperpar.data/corpus/shakespeare.jsonl")).read_text().splitlines()[:60]
    datasets.Dataset.from_dict({"text": [json.loads(ln)["text"] for ln in lines]}).save_to_disk(str(root / "hf"))
    return ["data=hf", f"data.path={root / 'hf'}", f"data.tokenizer={TOKENIZER}"]


def _preset(root: Path) -> list[str]:
    from safetensors.torch import save_file

    ctx = DataContext(seq_len=64, seed=0, num_samples=24, vocab_size=2048)
    src = build_dataset("json", context=ctx, path="pkg://hyperpar.data/corpus/shakespeare.jsonl", tokenizer=TOKENIZER,
                        shuffle=False)
    ids = torch.stack([torch.cat([src[i]["input_ids"], src[i]["labels"][-1:]]) for i in range(24)])
    save_file({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}, str(root / "preset.safetensors"))
    return ["data=preset", f"data.path={root / 'preset.safetensors'}", "data.shuffle=true"]


def _megatron(root: Path) -> list[str]:
    from hyperpar.data.hf import resolve_path
    from hyperpar.data.megatron.convert import convert

    convert(resolve_path("pkg://hyperpar.data/corpus/shakespeare.jsonl"), resolve_path(TOKENIZER), str(root / "corpus"),
            append_eod=True, progress=False)
    return ["data=megatron", f"data.blend='0.5 {root / 'corpus'} 0.5 {root / 'corpus'}'", f"data.cache_dir={root / 'idx'}"]


@pytest.mark.slow
# every source goes through the same distributed loader: CI keeps the HF and Megatron sources
@pytest.mark.parametrize("make", [pytest.param(lambda root: ["data=json"], marks=pytest.mark.full), _hf_dataset,
                                  pytest.param(_preset, marks=pytest.mark.full), _megatron],
                         ids=["json", "hf", "preset", "megatron"])
def test_single_vs_fsdp2_parity(tmp_path, make):
    data_args = make(tmp_path)
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single,fsdp2", "+experiment=parity", "train.steps=10", "train.seq_len=64",
                   *data_args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    base, other = read_losses(sweep / "0"), read_losses(sweep / "1")
    assert sorted(base) == sorted(other) == list(range(1, 11))
    worst = max(abs(base[s] - other[s]) for s in base)
    assert worst <= 1e-5, worst
    assert json.loads((sweep / "parity.json").read_text())["passed"] is True
    assert base[10] < base[1]  # real text: the loss goes down


def test_megatron_token_outside_the_model_vocabulary_is_a_data_error(megatron_prefix, tmp_path):
    """A corpus tokenized with a larger vocabulary than the model's (or a damaged .bin) used to pass every
    check and end in 'IndexError: index out of range in self' from the embedding, a traceback wall at
    whichever step first read such a token (a device-side assert on GPU)."""
    import numpy as np

    ctx = DataContext(seq_len=16, seed=5, num_samples=40, vocab_size=2048)
    small = DataContext(seq_len=16, seed=5, num_samples=40, vocab_size=100)  # the corpus uses ids up to ~2000
    src = build_dataset("megatron", context=small, prefix=megatron_prefix, cache_dir=str(tmp_path / "c"),
                        tokenizer=TOKENIZER)
    with pytest.raises(DataError, match=r"sample \d+ holds token id \d+, outside the model's vocabulary of 100 ids"):
        for i in range(len(src)):
            src[i]
    ok = build_dataset("megatron", context=ctx, prefix=megatron_prefix, cache_dir=str(tmp_path / "c"),
                       tokenizer=TOKENIZER)
    assert all(int(ok[i]["input_ids"].max()) < 2048 for i in range(len(ok)))
    assert np.all([int(ok[i]["labels"].min()) >= -100 for i in range(len(ok))])
