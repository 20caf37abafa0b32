"""Qwen3.5 dense vision-language (``qwen3_5_vl``): logits and gradients equal to transformers'
Qwen3_5ForConditionalGeneration for text / image / video / mixed inputs (fp32); HF directories in
and out; checkpoints with tensors the model does not read; text-only loads; geometry overrides on
a checkpoint; training through the CLI, one process and FSDP over two."""

from __future__ import annotations

import copy
import json
import logging
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fixtures import IMG, VE, VID, VS, qwen3_5, qwen3_5_vision
from helpers import cli_small, hf_named_grads, one_error_line, perturb_, read_losses, vl_inputs
from hyperpar.errors import CheckpointError, ConfigError
from hyperpar.models import from_hf, to_hf
from hyperpar.models.qwen3_5 import (
    VL_FLAVORS,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5VLArgs,
    Qwen3_5VLStateDictAdapter,
)

transformers = pytest.importorskip("transformers")

IDS = (IMG, VID, VS, VE)


def tiny_vl(tie: bool = True, vision: dict | None = None, **text_changes) -> dict:
    """tiny_configs/qwen3_5_vl.json: the tiny dense text model + a depth-2 ViT, tied at the top level."""
    text = {k: v for k, v in qwen3_5(**text_changes).items() if k not in ("architectures", "dtype", "transformers_version")}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "tie_word_embeddings": tie},
        "vision_config": vision or qwen3_5_vision(model_type="qwen3_5_vision"),
        "image_token_id": IMG, "video_token_id": VID, "vision_start_token_id": VS, "vision_end_token_id": VE,
        "tie_word_embeddings": tie,
    }  # fmt: skip


# Unusual vision constants: 2 channels, 6-pixel patches, 3 frames per temporal patch, 3×3 merge,
# 4 heads of 12 (rotary quarters of 3), a 5×5 position grid, exact GELU in the blocks, depth 3.
ODD_VISION = {
    "depth": 3, "hidden_act": "gelu", "hidden_size": 48, "in_channels": 2, "initializer_range": 0.02,
    "intermediate_size": 40, "model_type": "qwen3_5_vision", "num_heads": 4, "num_position_embeddings": 25,
    "out_hidden_size": 64, "patch_size": 6, "rope_parameters": {"rope_theta": 500.0, "rope_type": "axial"},
    "spatial_merge_size": 3, "temporal_patch_size": 3,
}  # fmt: skip

ROWS = {
    "text": [[24], [24]],
    "image": [[3, ("image", (1, 4, 6)), 13], [3, ("image", (1, 6, 4)), 13]],
    "video": [[3, ("video", (2, 4, 4)), 3]],
    # images and a video in one row, an image in the other: both modalities in one tower pass
    "mixed": [[2, ("image", (1, 4, 6)), 2, ("video", (2, 4, 4)), 2], [5, ("image", (1, 6, 4)), 4]],
}
ODD_ROWS = [[2, ("image", (1, 3, 6)), 2, ("video", (2, 3, 3)), 2], [4, ("image", (1, 6, 3)), ("image", (1, 3, 3)), 3]]


def batch(rows: list[list], cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    v = cfg["vision_config"]
    width = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    return vl_inputs(rows, patch_dim=width, merge=v["spatial_merge_size"], ids=IDS, seed=seed)


def make_hf(cfg: dict, seed: int = 0):
    from transformers import Qwen3_5Config
    from transformers import Qwen3_5ForConditionalGeneration as HFModel

    torch.manual_seed(seed)
    return perturb_(HFModel(Qwen3_5Config(**copy.deepcopy(cfg))).float().train(), seed + 1)


def ours_from(sd: dict[str, torch.Tensor], cfg: dict) -> Qwen3_5ForConditionalGeneration:
    args = Qwen3_5VLArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    adapter = Qwen3_5VLStateDictAdapter(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(adapter.load_param(name, sd.__getitem__))
    return model.train()


def shifted(labels: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


def inputs_of(b: dict) -> dict:
    return {k: v for k, v in b.items() if k != "labels"}


def check_against_transformers(cfg: dict, b: dict, seed: int = 0) -> None:
    hf = make_hf(cfg, seed)
    ours = ours_from(hf.state_dict(), cfg)
    ref = hf(**inputs_of(b), labels=b["labels"], use_cache=False)
    logits = ours(**inputs_of(b))
    assert logits.shape == ref.logits.shape
    assert (logits - ref.logits).abs().max().item() <= 1e-5
    loss = F.cross_entropy(logits.flatten(0, 1), shifted(b["labels"]).flatten(), ignore_index=-100)
    assert abs(loss.item() - ref.loss.item()) <= 1e-5
    ref.loss.backward()
    loss.backward()
    mine = hf_named_grads(ours)
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        assert name in mine, name
        assert (mine[name] - p.grad).abs().max().item() <= 1e-5, name
    if "pixel_values" in b or "pixel_values_videos" in b:  # the vision tower learned from this batch
        assert mine["model.visual.patch_embed.proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("kind", ["text", "image", "video", "mixed"])
def test_matches_transformers(kind: str) -> None:
    cfg = tiny_vl()
    check_against_transformers(cfg, batch(ROWS[kind], cfg))


def test_matches_transformers_with_unusual_vision_constants() -> None:
    cfg = tiny_vl(tie=False, vision=ODD_VISION)
    check_against_transformers(cfg, batch(ODD_ROWS, cfg), seed=3)


def test_positions_are_transformers_rope_index() -> None:
    from hyperpar.models.multimodal import get_rope_index

    cfg = tiny_vl()
    hf = make_hf(cfg)
    b = batch(ROWS["mixed"], cfg)
    ref, _ = hf.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], b["image_grid_thw"], b["video_grid_thw"])
    ours, _ = get_rope_index(b["input_ids"], b["mm_token_type_ids"], b["image_grid_thw"], b["video_grid_thw"],
                             spatial_merge_size=2)
    assert torch.equal(ours, ref)


# --- HF directories -------------------------------------------------------------------------------


def saved(tmp_path: Path, cfg: dict, seed: int = 0, name: str = "hf") -> tuple[Path, torch.nn.Module]:
    hf = make_hf(cfg, seed).eval()
    d = tmp_path / name
    hf.save_pretrained(str(d))
    return d, hf


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_is_bitwise_and_reloads_in_transformers(tmp_path: Path, tie: bool) -> None:
    from transformers import AutoModelForImageTextToText

    src, hf = saved(tmp_path, tiny_vl(tie=tie), seed=5)
    ours = from_hf(src)
    assert isinstance(ours, Qwen3_5ForConditionalGeneration)
    assert (ours.lm_head.weight is ours.model.language_model.embed_tokens.weight) == tie
    to_hf(ours, tmp_path / "out")
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(after) == set(before) and any(k.startswith("model.visual.") for k in after)
    for key, t in before.items():
        assert torch.equal(after[key], t), key
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3_5ForConditionalGeneration"
    b = inputs_of(batch(ROWS["mixed"], tiny_vl()))
    with torch.no_grad():
        ref = hf(**b, use_cache=False).logits
        assert torch.equal(reloaded(**b, use_cache=False).logits, ref)
        assert (ours(**b) - ref).abs().max().item() <= 1e-5


@contextmanager
def notes():
    """The log lines of hyperpar.models (a handler of its own: a run in this process may have
    stopped the hyperpar loggers from propagating to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("hyperpar.models")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _one_line(e: pytest.ExceptionInfo) -> str:
    line = e.value.one_line()
    assert "\n" not in line
    return line


def test_unknown_tensor_is_refused_in_one_line(tmp_path: Path) -> None:
    from hyperpar.models.build import ModelBuilder

    d, _ = saved(tmp_path, tiny_vl())
    sd = load_file(str(d / "model.safetensors"))
    sd["model.visual.extra_head.weight"] = torch.zeros(3, 4)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds 1 tensors the model does not use: model\.visual\.extra_head\.weight") as e:
        from_hf(d)
    assert "allow_unused" in _one_line(e)
    with pytest.raises(CheckpointError, match="extra_head"):
        ModelBuilder(name="qwen3_5_vl", hf_path=str(d)).build_meta()
    with notes() as lines:
        model = from_hf(d, allow_unused=True)
    assert isinstance(model, Qwen3_5ForConditionalGeneration)
    assert len(lines) == 1 and "extra_head" in lines[0]


def test_text_only_load_is_explicit_and_says_what_it_left_out(tmp_path: Path) -> None:
    from hyperpar.models.build import ModelBuilder

    d, hf = saved(tmp_path, tiny_vl())
    with pytest.raises(ConfigError, match="vision-language checkpoint") as e:
        ModelBuilder(name="qwen3_5", hf_path=str(d))
    assert "model=qwen3_5_vl" in _one_line(e) and "text_only" in _one_line(e)
    with pytest.raises(ConfigError, match="text_only"):
        ModelBuilder(name="qwen3_5_vl", hf_path=str(d), text_only=True)
    with notes() as lines:
        text = from_hf(d, text_only=True)
    assert len(lines) == 1 and "left out" in lines[0] and "the vision tower" in lines[0], lines
    assert isinstance(text, Qwen3_5ForCausalLM)
    ids = batch(ROWS["text"], tiny_vl())["input_ids"]
    with torch.no_grad():
        assert (text(ids) - hf(input_ids=ids, use_cache=False).logits).abs().max().item() <= 1e-5
    builder = ModelBuilder(name="qwen3_5", hf_path=str(d), text_only=True)
    assert isinstance(builder.build_meta(), Qwen3_5ForCausalLM)


# --- geometry overrides on a checkpoint --------------------------------------------------------------


def test_layer_override_loads_first_layers_like_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3_5Config
    from transformers import Qwen3_5ForConditionalGeneration as HFModel

    from hyperpar.distributed.materialize import materialize
    from hyperpar.models.build import ModelBuilder

    cfg = tiny_vl(vision=qwen3_5_vision(model_type="qwen3_5_vision", depth=3))
    d, _ = saved(tmp_path, cfg)
    with notes() as lines:
        builder = ModelBuilder(name="qwen3_5_vl", hf_path=str(d), num_hidden_layers=2, overrides={"vision": {"depth": 1}})
        model = materialize(builder.build_meta(), torch.device("cpu"), seed=0, source=builder.weight_source())
    assert len(lines) == 1 and "text layers 2-3" in lines[0] and "vision blocks 1-2" in lines[0], lines
    assert builder.args.text.layer_types == ["linear_attention", "full_attention"]
    assert len(model.model.language_model.layers) == 2 and len(model.model.visual.blocks) == 1

    # transformers' model from the same checkpoint with the same override
    cut = copy.deepcopy(cfg)
    cut["text_config"].update(num_hidden_layers=2, layer_types=cfg["text_config"]["layer_types"][:2])
    cut["vision_config"]["depth"] = 1
    ref_model = HFModel.from_pretrained(str(d), config=Qwen3_5Config(**cut), dtype=torch.float32).eval()
    b = inputs_of(batch(ROWS["mixed"], cfg))
    with torch.no_grad():
        assert (model.eval()(**b) - ref_model(**b, use_cache=False).logits).abs().max().item() <= 1e-5


def test_overrides_that_contradict_the_checkpoint_are_one_line_errors(tmp_path: Path) -> None:
    from hyperpar.models.build import ModelBuilder

    d, _ = saved(tmp_path, tiny_vl())
    cases = [
        (ConfigError, "more than the checkpoint's 4", dict(num_hidden_layers=6)),
        (ConfigError, "layer_types has 3 entries for 2 layers",
         dict(num_hidden_layers=2, overrides={"layer_types": ["linear_attention"] * 3})),
        (ConfigError, "contradicts", dict(num_hidden_layers=2, overrides={"num_hidden_layers": 3})),
        (ConfigError, "no such geometry field", dict(overrides={"num_hiden_layers": 2})),
        (CheckpointError, "wrong shape", dict(overrides={"intermediate_size": 96})),
    ]
    for kind, match, kwargs in cases:
        with pytest.raises(kind, match=match) as e:
            ModelBuilder(name="qwen3_5_vl", hf_path=str(d), **kwargs).build_meta()
        _one_line(e)
    # rotary fields are given flat and land where the config nests them (rope_parameters), text and vision
    rope = ModelBuilder(name="qwen3_5_vl", hf_path=str(d), overrides={
        "rope_theta": 5.0, "partial_rotary_factor": 0.5, "mrope_section": [6, 5, 5], "vision": {"rope_theta": 500.0}})
    rope.build_meta()
    text = rope.args.text
    assert (text.rope_theta, text.partial_rotary_factor, text.mrope_section) == (5.0, 0.5, [6, 5, 5])
    assert rope.args.vision.rope_theta == 500.0
    from hyperpar.models.geometry_overrides import check_applied

    with pytest.raises(ConfigError, match="did not take effect"):  # the guard behind every override
        check_applied(rope.args, {"rope_theta": 6.0})
    # without weights the override builds a fresh, larger model
    fresh = ModelBuilder(name="qwen3_5_vl", hf_path=str(d), load_weights=False, num_hidden_layers=8,
                         overrides={"layer_types": ["linear_attention", "full_attention"] * 4})
    assert fresh.args.text.num_hidden_layers == 8 and fresh.weight_source() is None


def test_flavours_and_spec() -> None:
    from hyperpar.models.spec import get_model_spec, spec_for_hf_config

    spec = get_model_spec("qwen3_5_vl")
    assert spec.default_data == "vl_dummy" and set(spec.flavors) >= {"debug", "0.8b", "4b", "9b", "27b"}
    assert spec_for_hf_config(tiny_vl()) is spec
    args = Qwen3_5VLArgs.from_hf_config(tiny_vl(tie=False, vision=ODD_VISION))
    assert Qwen3_5VLArgs.from_hf_config(args.to_hf_config()) == args
    with torch.device("meta"):
        m = Qwen3_5ForConditionalGeneration(VL_FLAVORS["0.8b"])
    n = sum(p.numel() for p in m.parameters())
    assert 0.8e9 <= n <= 0.95e9 and m.lm_head.weight is m.model.language_model.embed_tokens.weight
    assert m.flops_per_token(128) > 0
    with pytest.raises(ConfigError, match="out_hidden_size"):
        Qwen3_5VLArgs.from_hf_config(tiny_vl(vision=qwen3_5_vision(out_hidden_size=32)))


# --- training through the CLI -------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_trains_on_vl_dummy_and_fsdp2_matches_one_process(tmp_path: Path) -> None:
    args = ["model=qwen3_5_vl", "train.seq_len=32"]
    single, fsdp = tmp_path / "single", tmp_path / "fsdp2"
    res = cli_small(single, [*args, "parallel=single"], steps=4)
    assert res.returncode == 0, res.stderr[-3000:]
    # data=auto picked vl_dummy: its image/video placeholders are -100, text dummy data counts all 4 x 32
    tokens = [json.loads(line)["tokens"] for line in (single / "metrics.jsonl").read_text().splitlines()]
    assert len(tokens) == 4 and max(tokens) < 4 * 32 - 4
    res = cli_small(fsdp, [*args, "parallel=fsdp2"], steps=4)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_losses(single), read_losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5
    assert a[4] < a[1]


@pytest.mark.slow
def test_layer_override_of_a_checkpoint_trains(tmp_path: Path) -> None:
    d, _ = saved(tmp_path, tiny_vl())
    run = tmp_path / "run"
    res = cli_small(run, ["model=qwen3_5_vl", f"model.hf_path={d}", "model.num_hidden_layers=2", "train.seq_len=32"],
                    steps=3)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "text layers 2-3" in res.stderr
    losses = read_losses(run)
    assert len(losses) == 3 and all(v == v for v in losses.values())
    res = cli_small(tmp_path / "bad", ["model=qwen3_5", f"model.hf_path={d}"], steps=1)
    assert "vision-language checkpoint" in one_error_line(res)


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_vl_moe"])
def test_tie_override_ties_a_vl_model(name: str) -> None:
    """model.overrides.tie_word_embeddings on a VL family sets the flag the model ties by (the top
    level): neither refused (qwen3_5 VL families) nor silently left untied (qwen3_vl_moe)."""
    from hyperpar.models.build import ModelBuilder

    for tie in (True, False):
        builder = ModelBuilder(name=name, overrides={"tie_word_embeddings": tie})
        model = builder.build_meta()
        emb = next(p for n, p in model.named_parameters(remove_duplicate=False) if n.endswith("embed_tokens.weight"))
        assert builder.args.tie_word_embeddings is tie and (model.lm_head.weight is emb) is tie


def test_override_cuts_mtp_and_deepstack_with_their_stacks() -> None:
    from fixtures import qwen3_5_moe_vl, qwen3_vl_moe

    from hyperpar.models.geometry_overrides import apply_overrides, check_applied
    from hyperpar.models.qwen3_5_moe import Qwen3_5MoeVLArgs
    from hyperpar.models.qwen3_vl_moe import Qwen3VLMoeArgs

    moe = qwen3_5_moe_vl(mtp_num_hidden_layers=2)
    cfg, left = apply_overrides(moe, {"mtp_num_hidden_layers": 1, "num_hidden_layers": 3}, loading=True)
    args = Qwen3_5MoeVLArgs.from_hf_config(cfg)
    check_applied(args, {"mtp_num_hidden_layers": 1, "num_hidden_layers": 3})
    assert args.text.mtp_num_hidden_layers == 1 and len(args.text.layer_types) == 3
    assert ("mtp.layers.1.", "MTP layers 1-1") in left and ("model.language_model.layers.3.", "text layers 3-3") in left
    assert apply_overrides(moe, {"mtp_num_hidden_layers": 0}, loading=True)[1] == [("mtp.", "the MTP module")]

    vl = qwen3_vl_moe()  # DeepStack on blocks [0, 2] of 3
    cfg, left = apply_overrides(vl, {"vision": {"depth": 2}}, loading=True)
    assert Qwen3VLMoeArgs.from_hf_config(cfg).vision.deepstack_visual_indexes == [0]
    assert ("model.visual.deepstack_merger_list.1.", "DeepStack mergers") in left
    with pytest.raises(ConfigError, match="more than the checkpoint's 3"):
        apply_overrides(vl, {"vision": {"depth": 4}}, loading=True)
