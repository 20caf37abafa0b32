"""Hugging Face directories in and out: from_hf / to_hf / HFCheckpoint, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures import qwen3_5 as tiny
from hyperpar.errors import CheckpointError, ConfigError, HyperparError
from hyperpar.models import HFCheckpoint, from_hf, to_hf
from hyperpar.models.hf_io import parse_size
from hyperpar.models.qwen3_5 import Qwen3_5Args, Qwen3_5ForCausalLM

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

TINY = tiny()  # tiny_configs/qwen3_5_causal_lm.json (tests/fixtures.py)

IDS = torch.randint(0, 900, (2, 24), generator=torch.Generator().manual_seed(0))


def random_model(tied: bool, seed: int = 0) -> Qwen3_5ForCausalLM:
    """Our model initialised through the framework path (meta → to_empty → init_param), with
    norms and decays perturbed so every tensor matters."""
    args = Qwen3_5Args.from_hf_config(tiny(tie_word_embeddings=tied))
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(args)
    m.to_empty(device="cpu")
    m.init_buffers()
    for i, (name, p) in enumerate(m.named_parameters()):
        full = torch.empty(p.shape)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        m.init_param(name, full, gen)
        if "norm" in name or "A_log" in name or "dt_bias" in name:
            full += torch.randn(full.shape, generator=gen) * 0.2
        with torch.no_grad():
            p.copy_(full)
    return m.eval()


def hf_model_dir(tmp_path: Path, tied: bool = True) -> tuple[Path, torch.nn.Module]:
    """A directory written by transformers' own save_pretrained."""
    from transformers import Qwen3_5ForCausalLM as HFModel
    from transformers import Qwen3_5TextConfig

    torch.manual_seed(0)
    hf = HFModel(Qwen3_5TextConfig(**tiny(tie_word_embeddings=tied))).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    d = tmp_path / "hf"
    hf.save_pretrained(d)
    return d, hf


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shard", ["2GB", "150KB"])
def test_to_hf_reloads_in_transformers(tmp_path: Path, tied: bool, shard: str) -> None:
    from transformers import AutoModelForCausalLM

    ours = random_model(tied)
    to_hf(ours, tmp_path, max_shard_size=shard)
    files = sorted(p.name for p in tmp_path.iterdir())
    if shard == "2GB":
        assert files == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 2
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {f for f in files if f.startswith("model-")}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    hf_sd = hf.state_dict()
    from hyperpar.models.hf_io import hf_state_dict

    for name, t in hf_state_dict(ours).items():
        assert torch.equal(hf_sd[name], t), name  # bitwise: the export is lossless
    assert hf.config.tie_word_embeddings == tied
    with torch.no_grad():
        diff = (hf(input_ids=IDS, use_cache=False).logits - ours(IDS)).abs().max().item()
    assert diff <= 1e-6
    # and back through our own loader: identical
    again = from_hf(tmp_path)
    with torch.no_grad():
        assert torch.equal(again(IDS), ours(IDS))


def test_to_hf_replaces_stale_shards(tmp_path: Path) -> None:
    ours = random_model(True)
    to_hf(ours, tmp_path, max_shard_size="150KB")
    to_hf(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("tied", [True, False])
def test_from_hf_text_layout(tmp_path: Path, tied: bool) -> None:
    d, hf = hf_model_dir(tmp_path, tied)
    ours = from_hf(d)
    assert isinstance(ours, Qwen3_5ForCausalLM)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert (ours(IDS) - hf(input_ids=IDS, use_cache=False).logits).abs().max().item() <= 1e-5
    bf = from_hf(d, dtype=torch.bfloat16)
    assert bf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf.model.rotary_emb.inv_freq.dtype == torch.float32


def test_from_hf_vl_layout(tmp_path: Path) -> None:
    d, hf = hf_model_dir(tmp_path, tied=True)
    sd = load_file(d / "model.safetensors")
    vl = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in sd.items()}
    vl["model.visual.patch_embed.proj.bias"] = torch.zeros(32)  # ignored
    vl["mtp.fc.weight"] = torch.zeros(64, 128)  # ignored
    vdir = tmp_path / "vl"
    vdir.mkdir()
    half = sorted(vl)
    save_file({k: vl[k] for k in half[: len(half) // 2]}, vdir / "model-00001-of-00002.safetensors")
    save_file({k: vl[k] for k in half[len(half) // 2 :]}, vdir / "model-00002-of-00002.safetensors")
    wmap = {k: f"model-0000{1 if i < len(half) // 2 else 2}-of-00002.safetensors" for i, k in enumerate(half)}
    (vdir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    text = {k: v for k, v in TINY.items() if k not in ("architectures", "tie_word_embeddings")}
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 2}, "tie_word_embeddings": True}  # fmt: skip
    (vdir / "config.json").write_text(json.dumps(config))
    ours = from_hf(vdir, text_only=True)  # a VL checkpoint builds the VL model unless asked
    with torch.no_grad():
        assert (ours(IDS) - hf(input_ids=IDS, use_cache=False).logits).abs().max().item() <= 1e-5


def test_hf_checkpoint_reader(tmp_path: Path) -> None:
    ours = random_model(False)
    to_hf(ours, tmp_path, max_shard_size="150KB")
    with HFCheckpoint(tmp_path) as ckpt:
        assert ckpt.config["model_type"] == "qwen3_5_text"
        from hyperpar.models.hf_io import hf_state_dict

        assert set(ckpt.keys()) == set(hf_state_dict(ours)) | {"lm_head.weight"}
        assert "lm_head.weight" in ckpt
        assert torch.equal(ckpt.read("model.norm.weight"), ours.model.norm.weight)
        meta = ckpt.read_meta("model.layers.0.linear_attn.in_proj_qkv.weight")
        assert meta.is_meta and tuple(meta.shape) == (192, 64)
        with pytest.raises(KeyError):
            ckpt.read("nope")
        with pytest.raises(CheckpointError):
            ckpt.read("nope")


def test_parse_size() -> None:
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("150KB") == 150_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("lots")


def _one_line(e: HyperparError) -> str:
    line = e.one_line()
    assert "\n" not in line
    return line


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as e:
        from_hf(tmp_path / "missing")
    _one_line(e.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json") as e:
        from_hf(empty)
    _one_line(e.value)

    d = tmp_path / "model"
    to_hf(random_model(False), d)
    cfg = json.loads((d / "config.json").read_text())

    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="llama") as e:
        from_hf(d)
    _one_line(e.value)

    # missing tensor: named in the message
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.2.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing 1: model\.layers\.2\.mlp\.up_proj\.weight") as e:
        from_hf(d)
    _one_line(e.value)

    # wrong shape: config says a wider MLP than the weights hold
    to_hf(random_model(False), d)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"wrong shape .*mlp\.\w+_proj\.weight \((128, 64|64, 128)\) != expected") as e:
        from_hf(d)
    _one_line(e.value)

    # no weights at all
    (d / "model.safetensors").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no \\*.safetensors") as e:
        from_hf(d)
    _one_line(e.value)


def test_transformers_moe_save_without_mtp_weights_loads_without_mtp(tmp_path: Path, hyperpar_log) -> None:
    """transformers' save_pretrained of a Qwen3.5-MoE keeps mtp_num_hidden_layers in config.json but writes no
    mtp.* tensors (transformers does not model MTP): such a checkpoint loads as transformers loads it, without
    the MTP module, said in one line; it was refused. Training MTP on it (mtp_loss_weight > 0) is refused
    naming the missing tensors."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from fixtures import qwen3_5_moe
    from hyperpar.models.build import ModelBuilder

    d = tmp_path / "hf"
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_moe(mtp_num_hidden_layers=1))).eval()
    hf.save_pretrained(d)
    model = ModelBuilder(name="qwen3_5_moe", hf_path=str(d)).build_meta()
    assert getattr(model, "mtp", None) is None
    assert any("no mtp.* tensors" in line for line in hyperpar_log), hyperpar_log
    with torch.no_grad():
        assert (from_hf(d)(IDS).logits - hf(input_ids=IDS, use_cache=False).logits).abs().max().item() <= 1e-5
    with pytest.raises(CheckpointError, match=r"missing \d+: mtp\.") as e:
        ModelBuilder(name="qwen3_5_moe", hf_path=str(d), mtp_loss_weight=0.3).build_meta()
    assert "model.mtp_loss_weight=0" in _one_line(e.value)


def test_zero_width_shared_expert_and_dense_mtp_tensors_load_as_in_transformers(tmp_path: Path, hyperpar_log) -> None:
    """shared_expert_intermediate_size 0: transformers writes empty shared_expert.* tensors and a gate that scales
    zeros; a dense checkpoint may carry released mtp.* tensors that transformers ignores. Both were refused as
    unused tensors (model.allow_unused_weights=true was needed); they load, said in one line, logits as HF's."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from fixtures import qwen3_5_moe

    d = tmp_path / "moe"
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_moe(shared_expert_intermediate_size=0))).eval()
    hf.save_pretrained(d)
    assert any(".shared_expert." in k for k in load_file(d / "model.safetensors"))
    with torch.no_grad():
        assert (from_hf(d)(IDS).logits - hf(input_ids=IDS, use_cache=False).logits).abs().max().item() <= 1e-5
    assert any("zero-width shared expert" in line for line in hyperpar_log), hyperpar_log

    dense, _ = hf_model_dir(tmp_path / "dense", tied=False)
    sd = load_file(dense / "model.safetensors")
    sd["mtp.fc.weight"] = torch.zeros(4, 8)
    save_file(sd, dense / "model.safetensors", metadata={"format": "pt"})
    from_hf(dense)
    assert any("the MTP module" in line for line in hyperpar_log), hyperpar_log


def test_a_damaged_shard_is_named_not_reported_as_missing_tensors(tmp_path: Path) -> None:
    """A truncated shard was reported as 'missing 5: model.layers.0...' with the hint to check config.json; an
    index naming the wrong shard for a tensor was a raw SafetensorError traceback. Both name the file now."""
    from transformers import Qwen3_5ForCausalLM as HFModel
    from transformers import Qwen3_5TextConfig

    from hyperpar.models.build import ModelBuilder

    d = tmp_path / "sharded"
    HFModel(Qwen3_5TextConfig(**tiny())).save_pretrained(d, max_shard_size="100KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    (d / shards[1]).write_bytes((d / shards[1]).read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        ModelBuilder(name="qwen3_5", hf_path=str(d)).build_meta()
    assert shards[1] in _one_line(e.value) and "missing" not in str(e.value)

    d2 = tmp_path / "index"
    HFModel(Qwen3_5TextConfig(**tiny())).save_pretrained(d2, max_shard_size="100KB")
    index = json.loads((d2 / "model.safetensors.index.json").read_text())
    key = next(k for k, f in index["weight_map"].items() if f == shards[1])
    index["weight_map"][key] = shards[2]
    (d2 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"cannot read tensor '{key}' from .*{shards[2]}") as e:
        from_hf(d2)
    _one_line(e.value)


def test_fit_to_checkpoint_keeps_mtp_that_a_vl_run_trains() -> None:
    """The VL MoE family holds mtp_loss_weight at its top level, not in its text args: a run that trains MTP on a
    checkpoint without mtp.* tensors must keep the module (and be told the tensors are missing), not drop it."""
    from hyperpar.models.hf_io import fit_to_checkpoint
    from hyperpar.models.qwen3_5_moe.args import VL_FLAVORS

    vl = VL_FLAVORS["debug"]
    assert vl.text.mtp_num_hidden_layers == 1
    dropped, _, notes = fit_to_checkpoint(vl, ["model.language_model.embed_tokens.weight"])
    assert dropped.text.mtp_num_hidden_layers == 0 and len(notes) == 1
    kept, _, notes = fit_to_checkpoint(vl.replace(mtp_loss_weight=0.3), ["model.language_model.embed_tokens.weight"])
    assert kept.text.mtp_num_hidden_layers == 1 and notes == []
    assert fit_to_checkpoint(vl, ["mtp.fc.weight"])[0] == vl  # the tensors are there: nothing changes
