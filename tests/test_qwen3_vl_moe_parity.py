"""Qwen3-VL-MoE: logits / aux loss / gradients equal to transformers' Qwen3VLMoeForConditionalGeneration
(fp32, tiny config), HF import and export, and the model's input contract."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from fixtures import IMG, VE, VID, VS
from fixtures import qwen3_vl_moe as tiny
from helpers import hf_named_grads
from hyperpar.errors import DataError
from hyperpar.models import from_hf, to_hf
from hyperpar.models.output import ModelOutput
from hyperpar.models.qwen3_vl_moe import (
    FLAVORS,
    Qwen3VLMoeArgs,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeStateDictAdapter,
)
from hyperpar.models.spec import get_model_spec, spec_for_hf_model_type

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

TINY = tiny()  # tiny_configs/qwen3_vl_moe.json (tests/fixtures.py)
COEF = 0.001


def make_hf(cfg: dict, seed: int = 0):
    from transformers import Qwen3VLMoeConfig
    from transformers import Qwen3VLMoeForConditionalGeneration as HFModel

    torch.manual_seed(seed)
    model = HFModel(Qwen3VLMoeConfig(**copy.deepcopy(cfg))).float().train()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms away from their init value, so a wrong norm kind shows
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def load_ours(state_dict: dict, cfg: dict) -> Qwen3VLMoeForConditionalGeneration:
    args = Qwen3VLMoeArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    adapter = Qwen3VLMoeStateDictAdapter(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(adapter.load_param(name, state_dict.__getitem__))
    return model.train()


# --- the verification inputs of MODELS.md 14 -------------------------------------------------------


def text_batch() -> dict:
    return {"input_ids": torch.randint(0, 900, (2, 24), generator=torch.Generator().manual_seed(0))}


def image_batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(2):
        t = torch.randint(0, 900, (16,), generator=gen).tolist()
        rows.append(t[:3] + [VS] + [IMG] * 6 + [VE] + t[3:])
    ids = torch.tensor(rows)
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(48, 1536, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 6], [1, 6, 4]]),
        "mm_token_type_ids": (ids == IMG).to(torch.int32),
    }


def video_batch() -> dict:
    row = [5, 6, 7]
    for g in range(2):
        row += [100 + g, 101 + g, VS] + [VID] * 4 + [VE]
    row += [8, 9, 10]
    ids = torch.tensor([row])
    return {
        "input_ids": ids,
        "pixel_values_videos": torch.randn(32, 1536, generator=torch.Generator().manual_seed(2)),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "mm_token_type_ids": ((ids == VID) * 2).to(torch.int32),
    }


def mixed_batch() -> dict:
    """Images and a video in one batch: DeepStack features of both kinds at their own positions."""
    gen = torch.Generator().manual_seed(3)
    r0 = [1, 2, VS] + [IMG] * 4 + [VE, 3, 4] + [VS] + [VID] * 2 + [VE] + [5, 6, 7, 8, VS] + [IMG] * 2 + [VE, 9]
    r1 = [11, 12, 13, VS] + [VID] * 2 + [VE, 14, 15, 16] + torch.randint(0, 900, (13,), generator=gen).tolist()
    ids = torch.tensor([r0, r1])
    image_grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    video_grid = torch.tensor([[1, 2, 4], [1, 4, 2]])
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(24, 1536, generator=gen),
        "image_grid_thw": image_grid,
        "pixel_values_videos": torch.randn(16, 1536, generator=gen),
        "video_grid_thw": video_grid,
        "mm_token_type_ids": torch.where(ids == IMG, 1, torch.where(ids == VID, 2, 0)).to(torch.int32),
    }


BATCHES = {"text": text_batch, "image": image_batch, "video": video_batch, "mixed": mixed_batch}


def hf_labels(ids: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill((ids == IMG) | (ids == VID), -100)


def run_hf(hf, batch: dict, labels: torch.Tensor | None = None):
    return hf(**batch, labels=labels, use_cache=False, output_router_logits=True)


@pytest.fixture(scope="module")
def pair():
    cfg = tiny()
    hf = make_hf(cfg)
    return hf, load_ours(hf.state_dict(), cfg)


@pytest.mark.parametrize("kind", list(BATCHES))
def test_logits_and_aux_match_transformers(pair, kind: str) -> None:
    hf, ours = pair
    batch = BATCHES[kind]()
    with torch.no_grad():
        ref = run_hf(hf, batch)
        out = ours(**batch)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == ref.logits.shape
    diff = (out.logits - ref.logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert abs(out.aux_loss.item() - COEF * ref.aux_loss.item()) <= 1e-9


def test_positions_given_explicitly_match(pair) -> None:
    hf, ours = pair
    batch = image_batch()
    pos, _ = hf.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    with torch.no_grad():
        ref = run_hf(hf, {**batch, "position_ids": pos}).logits
        got = ours(**{**batch, "position_ids": pos}).logits
        default = ours(**batch).logits
    assert (got - ref).abs().max().item() <= 1e-5
    assert torch.equal(got, default)


def test_loss_and_grads_match_transformers() -> None:
    cfg = tiny()
    hf = make_hf(cfg, seed=4)
    ours = load_ours(hf.state_dict(), cfg)
    batch = mixed_batch()
    labels = hf_labels(batch["input_ids"])
    ref = run_hf(hf, batch, labels=labels)
    out = ours(**batch)
    lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
    loss = lm + out.aux_loss
    assert abs(loss.item() - ref.loss.item()) <= 1e-5
    ref.loss.backward()
    loss.backward()
    assert all(p.grad is not None for p in ours.parameters())
    hf_params = dict(hf.named_parameters())
    for name, g in hf_named_grads(ours).items():
        want = hf_params[name].grad
        assert (g - want).abs().max().item() <= 1e-5 + 1e-4 * want.abs().max().item(), name


def test_dense_layers_and_sparse_step() -> None:
    """mlp_only_layers and decoder_sparse_step put dense MLPs on some layers; aux pools the MoE ones."""
    cfg = tiny(mlp_only_layers=[0], decoder_sparse_step=2)  # MoE on layers 1 and 3 only
    hf = make_hf(cfg, seed=5)
    ours = load_ours(hf.state_dict(), cfg)
    assert [layer.is_moe for layer in ours.model.language_model.layers.values()] == [False, True, False, True]
    batch = image_batch()
    with torch.no_grad():
        ref = run_hf(hf, batch)
        out = ours(**batch)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    assert abs(out.aux_loss.item() - COEF * ref.aux_loss.item()) <= 1e-9


def test_export_reloads_in_transformers_and_from_hf(tmp_path) -> None:
    from transformers import Qwen3VLMoeForConditionalGeneration as HFModel

    for tie in (False, True):
        cfg = tiny(tie=tie)
        hf = make_hf(cfg, seed=6)
        ours = load_ours(hf.state_dict(), cfg)
        assert (ours.lm_head.weight is ours.model.language_model.embed_tokens.weight) == tie
        out_dir = tmp_path / f"tie{tie}"
        to_hf(ours, out_dir)
        reloaded = HFModel.from_pretrained(out_dir, dtype=torch.float32).train()
        back = from_hf(out_dir).train()
        for kind in ("image", "mixed"):
            batch = BATCHES[kind]()
            with torch.no_grad():
                ref = run_hf(hf, batch).logits
                assert torch.equal(run_hf(reloaded, batch).logits, ref), kind
                mine = ours(**batch).logits
                assert torch.equal(back(**batch).logits, mine), kind
                assert (mine - ref).abs().max().item() <= 1e-5


def test_from_hf_reads_the_released_transposed_expert_layout(tmp_path) -> None:
    """Released Qwen3-VL-MoE files store gate_up_proj (E, H, 2·Ie) and down_proj (E, Ie, H)."""
    cfg = tiny()
    hf = make_hf(cfg, seed=7)
    sd = {}
    for key, t in hf.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = t.transpose(1, 2)
        sd[key] = t.contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = from_hf(tmp_path).train()
    batch = video_batch()
    with torch.no_grad():
        diff = (ours(**batch).logits - run_hf(hf, batch).logits).abs().max().item()
    assert diff <= 1e-5


def test_adapter_stacks_per_expert_keys() -> None:
    cfg = tiny()
    hf = make_hf(cfg, seed=8)
    sd = dict(hf.state_dict())
    packed_gu = sd.pop("model.language_model.layers.0.mlp.experts.gate_up_proj")
    packed_d = sd.pop("model.language_model.layers.0.mlp.experts.down_proj")
    for e in range(8):
        base = f"model.language_model.layers.0.mlp.experts.{e}"
        sd[f"{base}.gate_proj.weight"] = packed_gu[e, :48]
        sd[f"{base}.up_proj.weight"] = packed_gu[e, 48:]
        sd[f"{base}.down_proj.weight"] = packed_d[e]
    adapter = Qwen3VLMoeStateDictAdapter(Qwen3VLMoeArgs.from_hf_config(cfg))
    experts = "model.language_model.layers.0.mlp.experts"
    assert torch.equal(adapter.load_param(f"{experts}.gate_proj", sd.__getitem__), packed_gu[:, :48])
    assert torch.equal(adapter.load_param(f"{experts}.up_proj", sd.__getitem__), packed_gu[:, 48:])
    assert torch.equal(adapter.load_param("model.language_model.layers.0.mlp.experts.down_proj", sd.__getitem__), packed_d)


def test_placeholder_feature_mismatch_is_a_data_error(pair) -> None:
    _, ours = pair
    batch = image_batch()
    ids = batch["input_ids"].clone()
    ids[0, 4] = 7  # one image placeholder fewer than the grids' 12 features
    batch["input_ids"] = ids
    batch["mm_token_type_ids"] = (ids == IMG).to(torch.int32)
    with pytest.raises(DataError, match=r"11 image placeholder tokens.*12 image features"):
        ours(**batch)
    with pytest.raises(DataError, match="mm_token_type_ids"):
        ours(**{**image_batch(), "mm_token_type_ids": None})
    with pytest.raises(DataError, match="without"):
        ours(input_ids=ids, pixel_values=image_batch()["pixel_values"])


def test_input_embedding_accessors_drive_the_forward(pair) -> None:
    _, ours = pair
    model = copy.deepcopy(ours)
    emb = model.get_input_embeddings()
    assert emb is model.model.language_model.embed_tokens
    batch = image_batch()
    with torch.no_grad():
        before = model(**batch).logits
        new = torch.nn.Embedding(emb.num_embeddings, emb.embedding_dim)
        new.weight.copy_(emb.weight * 2.0)
        model.set_input_embeddings(new)
        assert model.get_input_embeddings() is new
        after = model(**batch).logits
        # text positions change; the placeholder rows are overwritten by vision features either way
        assert not torch.allclose(before, after)
        new.weight.copy_(emb.weight)
        assert torch.equal(model(**batch).logits, before)


def test_spec_flavours_and_training_step() -> None:
    spec = get_model_spec("qwen3_vl_moe")
    assert spec.default_data == "vl_dummy" and spec_for_hf_model_type("qwen3_vl_moe") is spec
    with torch.device("meta"):
        big = Qwen3VLMoeForConditionalGeneration(FLAVORS["30b_a3b"])
    n = sum(p.numel() for p in big.parameters())
    assert 30e9 < n < 32e9, n  # Qwen3-VL-30B-A3B
    assert Qwen3VLMoeArgs.from_hf_config(FLAVORS["30b_a3b"].to_hf_config()) == FLAVORS["30b_a3b"]

    # debug flavour: fresh init through init_param, one step on vl_dummy data, every parameter learns
    from hyperpar.data.registry import DataContext, build_dataset

    args = FLAVORS["debug"]
    model = Qwen3VLMoeForConditionalGeneration(args)
    gen_seed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = torch.empty(p.shape)
            model.init_param(name, full, torch.Generator().manual_seed(gen_seed))
            gen_seed += 1
            p.copy_(full)
    model.init_buffers()
    ctx = DataContext(seq_len=64, seed=0, num_samples=8, vocab_size=args.vocab_size, model_args=args, default_type="vl_dummy")
    source = build_dataset("auto", context=ctx, extra={"video_fraction": 0.5})
    samples = [source[i] for i in range(8)]
    image = next(s for s in samples if "pixel_values" in s)
    video = next(s for s in samples if "pixel_values_videos" in s)
    batch = source.collate([image, video])
    labels = batch.pop("labels")
    out = model(**batch)
    loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100) + out.aux_loss
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
