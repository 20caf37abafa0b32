"""Qwen3.5-MoE text: logits, loss, gradients and aux loss equal to transformers'
Qwen3_5MoeForCausalLM (fp32); HF import/export in every expert key form; the MTP module."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fixtures import qwen3_5_moe as tiny
from fixtures import qwen3_5_moe_vl
from hyperpar.errors import ConfigError
from helpers import hf_named_grads, perturb_
from hyperpar.models import from_hf, to_hf
from hyperpar.models.hf_io import hf_state_dict
from hyperpar.models.layers import cpu_matmul
from hyperpar.models.output import ModelOutput
from hyperpar.models.qwen3_5_moe import (
    FLAVORS,
    Qwen3_5MoeArgs,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeStateDictAdapter,
)
from hyperpar.models.spec import get_model_spec, spec_for_hf_model_type

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

TINY = tiny()  # tiny_configs/qwen3_5_moe_causal_lm.json (tests/fixtures.py)


def make_hf(cfg: dict, seed: int = 0):
    """transformers model with non-trivial norms, decays and routers (zero-init offset norms and
    near-uniform routers would hide bugs)."""
    from transformers import Qwen3_5MoeForCausalLM as HFModel
    from transformers import Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = HFModel(Qwen3_5MoeTextConfig(**cfg)).float().train()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def load_into_ours(sd_read, cfg: dict, **arg_changes) -> Qwen3_5MoeForCausalLM:
    """Our model built on meta, materialised, and loaded through the adapter (``sd_read(key)``)."""
    args = Qwen3_5MoeArgs.from_hf_config(cfg)
    if arg_changes:
        args = args.replace(**arg_changes)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    adapter = Qwen3_5MoeStateDictAdapter(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(adapter.load_param(name, sd_read))
    return model.train()


def ours_from_hf(hf, cfg: dict, **arg_changes) -> Qwen3_5MoeForCausalLM:
    return load_into_ours(hf.state_dict().__getitem__, cfg, **arg_changes)


def ids_for(S: int, B: int = 2) -> torch.Tensor:
    return torch.randint(0, 900, (B, S), generator=torch.Generator().manual_seed(0))


def positions(kind: str, B: int, S: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "2d":
        return torch.arange(S).unsqueeze(0) + torch.tensor([[0], [5]])[:B]
    t = torch.arange(S)
    thw = torch.stack([t, t // 2 + 1, (t * 7) % 11]).unsqueeze(1).expand(3, B, S)
    if kind == "3d":
        return thw.contiguous()
    return torch.cat([t.expand(1, B, S), thw], dim=0)


def shifted(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return labels


@pytest.mark.parametrize("S", [24, 70])
def test_logits_match_transformers(S: int) -> None:
    hf = make_hf(TINY)
    ours = ours_from_hf(hf, TINY)
    ids = ids_for(S)
    with torch.no_grad():
        for kind in ("none", "2d", "3d", "4d"):
            pos = positions(kind, 2, S)
            ref = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
            out = ours(ids, pos)
            assert isinstance(out, ModelOutput) and out.mtp_logits is None
            assert out.logits.shape == ref.shape == (2, S, TINY["vocab_size"])
            assert (out.logits - ref).abs().max().item() <= 1e-5, kind


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_loss_grads_and_aux_loss_match_transformers(impl: str) -> None:
    hf = make_hf(TINY, seed=1)
    ours = ours_from_hf(hf, TINY, experts_impl=impl)
    ids = ids_for(24)
    ref = hf(input_ids=ids, labels=ids, use_cache=False, output_router_logits=True)
    coef = TINY["router_aux_loss_coef"]
    ref_lm = ref.loss - coef * ref.aux_loss
    ref.loss.backward()
    out = ours(ids)
    lm = F.cross_entropy(out.logits.float().flatten(0, 1), shifted(ids).flatten(), ignore_index=-100)
    assert abs(lm.item() - ref_lm.item()) <= 1e-5
    assert abs(out.aux_loss.item() - coef * ref.aux_loss.item()) <= 1e-7
    assert abs(out.aux_loss.item() / coef - ref.aux_loss.item()) <= 1e-5
    (lm + out.aux_loss).backward()
    hf_params = dict(hf.named_parameters())
    ours_grads = hf_named_grads(ours)
    assert set(ours_grads) == set(hf_params)
    for name, g in ours_grads.items():
        g_ref = hf_params[name].grad
        assert g is not None and g_ref is not None, name
        assert (g - g_ref).abs().max().item() <= 1e-5, name


def test_aux_loss_ignores_padding_like_transformers() -> None:
    hf = make_hf(TINY, seed=2)
    ours = ours_from_hf(hf, TINY)
    ids = ids_for(24)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True)
        out = ours(ids, attention_mask=mask)
        unmasked = ours(ids)
    coef = TINY["router_aux_loss_coef"]
    assert abs(out.aux_loss.item() / coef - ref.aux_loss.item()) <= 1e-5
    assert abs(unmasked.aux_loss.item() - out.aux_loss.item()) > 1e-7
    real = mask.bool()
    assert (out.logits[real] - ref.logits[real]).abs().max().item() <= 1e-5


def test_bf16_close_to_transformers() -> None:
    hf = make_hf(TINY, seed=2)
    ours = ours_from_hf(hf, TINY)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = ids_for(70)
    # Like against like: transformers runs torch's own bf16 GEMM, so ours does here too (on a CPU
    # without bf16 GEMM, "auto" would sum in another order and break the same near-ties;
    # tests/test_cpu_matmul.py holds that path against fp32).
    before = cpu_matmul.set_policy("native")
    try:
        with torch.no_grad():
            ref = hf(input_ids=ids, use_cache=False).logits
            got = ours(ids).logits
    finally:
        cpu_matmul.set_policy(before)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # Measured 0.0059 (max |logit| 0.72; torch 2.13 CPU): 2x that. With other seeds a top-k tie that bf16
    # rounding breaks differently in the two implementations routes a token elsewhere (up to 0.035).
    assert (got.float() - ref.float()).abs().max().item() <= 0.012


# --- HF directories -------------------------------------------------------------------------------


def reload_in_transformers(path: Path, ours: Qwen3_5MoeForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Load ``path`` with transformers, check every weight is bitwise ours, return its logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    hf_sd = model.state_dict()
    for name, t in hf_state_dict(ours).items():
        if not name.startswith("mtp."):
            assert torch.equal(hf_sd[name], t), name  # the export is lossless
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_export_reloads_in_transformers_with_identical_logits(tmp_path: Path) -> None:
    hf = make_hf(TINY, seed=3)
    ours = ours_from_hf(hf, TINY)
    to_hf(ours, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and "lm_head.weight" in keys
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["num_experts"] == 8 and "intermediate_size" not in cfg
    ids = ids_for(24)
    with torch.no_grad():
        mine = ours(ids).logits
        original = hf(input_ids=ids, use_cache=False).logits
    reloaded = reload_in_transformers(tmp_path, ours, ids)
    assert torch.equal(reloaded, original)  # same weights, same implementation: bitwise
    assert (reloaded - mine).abs().max().item() <= 1e-5
    # and our own reader gets the same model back
    again = from_hf(tmp_path)
    assert isinstance(again, Qwen3_5MoeForCausalLM)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, mine)


def test_from_hf_reads_transformers_per_expert_files(tmp_path: Path) -> None:
    hf = make_hf(TINY, seed=4)
    hf.save_pretrained(str(tmp_path))
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys  # transformers writes per-expert keys
    ours = from_hf(tmp_path)
    ids = ids_for(24)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        assert (ours(ids).logits - ref).abs().max().item() <= 1e-5


def test_from_hf_reads_vl_layout_and_transposed_experts(tmp_path: Path) -> None:
    """A composite ``qwen3_5_moe`` checkpoint (model.language_model.*, model.visual.*, mtp.*) loads into
    the text family; legacy (E, H, 2·Ie) packing is recognised by shape."""
    hf = make_hf(TINY, seed=5)
    tensors = {}
    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            v = v.transpose(1, 2)
        tensors[k.replace("model.", "model.language_model.", 1)] = v.contiguous()
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    text = {k: v for k, v in TINY.items() if k not in ("architectures", "tie_word_embeddings", "transformers_version")}
    vl = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "text_config": text, "vision_config": {}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(vl))
    ours = get_model_spec("qwen3_5_moe")
    args = ours.args_cls.from_hf_config(vl)
    assert args == Qwen3_5MoeArgs.from_hf_config(TINY)
    from hyperpar.models.build import ModelBuilder
    from hyperpar.distributed.materialize import materialize

    builder = ModelBuilder(name="qwen3_5_moe", hf_path=str(tmp_path), text_only=True)
    model = materialize(builder.build_meta(), torch.device("cpu"), seed=0, source=builder.weight_source())
    ids = ids_for(24)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        assert (model(ids).logits - ref).abs().max().item() <= 1e-5


# --- MTP ------------------------------------------------------------------------------------------


def mtp_tensors(cfg: dict, hf, seed: int = 7, prefix: str = "model.layers.1.") -> dict[str, torch.Tensor]:
    """mtp.* weights in the inference engines' names: a full-attention MoE layer taken from layer 1
    (perturbed), fc (H, 2H) and three offset norms."""
    g = torch.Generator().manual_seed(seed)
    H = cfg["hidden_size"]
    sd = hf.state_dict()
    out = {}
    for k, v in sd.items():
        if k.startswith(prefix):
            out["mtp.layers.0." + k[len(prefix) :]] = v + 0.05 * torch.randn(v.shape, generator=g)
    out["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = torch.randn(H, generator=g) * 0.3
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_mtp_loads_and_produces_logits_only_when_weighted(tmp_path: Path) -> None:
    cfg = tiny(mtp_num_hidden_layers=1)
    hf = make_hf(TINY, seed=6)
    hf.save_pretrained(str(tmp_path))
    extra = mtp_tensors(TINY, hf)
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({**weights, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(saved))

    model = from_hf(tmp_path)
    assert model.mtp is not None and model.args.mtp_num_hidden_layers == 1 and model.args.mtp_loss_weight == 0
    sd = hf_state_dict(model)
    for k, v in extra.items():
        assert torch.equal(sd[k], v), k
    ids = ids_for(24)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        out = model(ids)
    assert out.mtp_logits is None
    assert (out.logits - ref).abs().max().item() <= 1e-5  # MTP never changes the main logits

    weighted = load_into_ours(lambda k: sd[k], cfg, mtp_loss_weight=0.5)
    pos = positions("3d", 2, 24)
    out_w = weighted(ids, pos)
    assert out_w.mtp_logits.shape == (2, 23, TINY["vocab_size"])
    assert torch.equal(out_w.logits, weighted(ids, pos).logits)

    # the MTP step by hand: fc([norm_e(embed(x_{t+1})); norm_h(h_t)]) → MTP layer → norm → lm_head
    with torch.no_grad():
        h = weighted.model(ids, pos)  # final hidden states (after the final norm)
        e = weighted.model.embed_tokens(ids[:, 1:])
        x = F.linear(torch.cat([rms(e, extra["mtp.pre_fc_norm_embedding.weight"]),
                                rms(h[:, :-1], extra["mtp.pre_fc_norm_hidden.weight"])], -1), extra["mtp.fc.weight"])
        cos, sin = weighted.model.rotary_emb(pos[..., 1:], x.dtype)
        x = weighted.mtp.layers["0"](x, cos, sin)
        manual = F.linear(rms(x, extra["mtp.norm.weight"]), weighted.lm_head.weight)
    assert (out_w.mtp_logits - manual).abs().max().item() <= 1e-5
    # its router joins the aux pool, and every MTP parameter learns from the MTP loss
    assert out_w.aux_loss.item() != out.aux_loss.item()
    labels = shifted(ids)
    mtp_loss = F.cross_entropy(out_w.mtp_logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    mtp_loss.backward()
    for name, p in weighted.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name

    # export carries mtp.* through; transformers ignores it and still matches the main logits
    out_dir = tmp_path / "export"
    to_hf(weighted, out_dir)
    exported = load_file(str(out_dir / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in extra.items())
    assert json.loads((out_dir / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    with torch.no_grad():
        assert torch.equal(reload_in_transformers(out_dir, weighted, ids), ref)


def test_mtp_weight_needs_an_mtp_module() -> None:
    with pytest.raises(ConfigError):
        Qwen3_5MoeArgs.from_hf_config(TINY).replace(mtp_loss_weight=0.3)


# --- framework ------------------------------------------------------------------------------------


def test_debug_flavour_trains_with_aux_and_mtp() -> None:
    args = FLAVORS["debug"].replace(mtp_loss_weight=0.3)
    assert set(args.layer_types[:2]) == set(args.layer_types[2:]) == {"linear_attention", "full_attention"}
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    for i, (name, p) in enumerate(model.named_parameters()):
        full = torch.empty(p.shape)
        model.init_param(name, full, torch.Generator().manual_seed(i))
        with torch.no_grad():
            p.copy_(full)
    n = sum(p.numel() for p in model.parameters())
    assert 1_500_000 <= n <= 4_000_000
    sd = hf_state_dict(model)
    assert torch.all(sd["mtp.pre_fc_norm_hidden.weight"] == 0) and 0.015 < sd["mtp.fc.weight"].std() < 0.025
    assert 0.015 < sd["model.layers.0.mlp.experts.gate_up_proj"].std() < 0.025
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    labels = shifted(ids)
    losses = []
    for _ in range(4):
        out = model(ids)
        loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        mtp = F.cross_entropy(out.mtp_logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        (loss + out.aux_loss + 0.3 * mtp).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.device("meta"):
        no_mtp = Qwen3_5MoeForCausalLM(FLAVORS["debug"])
    assert model.flops_per_token(32) > no_mtp.flops_per_token(32) > 0


def test_35b_flavour_builds_on_meta() -> None:
    args = FLAVORS["35b_a3b"]
    with torch.device("meta"):
        m = Qwen3_5MoeForCausalLM(args)
    n = sum(p.numel() for name, p in m.named_parameters() if not name.startswith("mtp."))
    assert 34e9 <= n <= 36e9
    assert m.model.layers["0"].mlp.experts.gate_proj.shape == (256, 512, 2048)
    assert m.model.layers["0"].mlp.experts.down_proj.shape == (256, 2048, 512)
    assert args.layer_types[3] == "full_attention" and args.mtp_num_hidden_layers == 1
    # active parameters: ~3B of 35B
    active = m.flops_per_token(1) / 6
    assert 2.5e9 <= active <= 4.0e9


def test_hf_config_round_trip_and_spec() -> None:
    from transformers import Qwen3_5MoeTextConfig

    args = Qwen3_5MoeArgs.from_hf_config(TINY)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (8, 2, 48)
    assert args.shared_expert_intermediate_size == 32 and args.router_aux_loss_coef == 0.001
    out = args.to_hf_config()
    assert out["model_type"] == "qwen3_5_moe_text" and out["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert Qwen3_5MoeArgs.from_hf_config(out) == args
    hf_cfg = Qwen3_5MoeTextConfig(**out)
    assert hf_cfg.num_experts == 8 and hf_cfg.layer_types == args.layer_types
    spec = get_model_spec("qwen3_5_moe")
    assert spec_for_hf_model_type("qwen3_5_moe_text") is spec
    assert "qwen3_5_moe" in spec.hf_model_types and spec.default_data == "dummy"
    assert set(spec.flavors) >= {"debug", "35b_a3b"}
    assert Qwen3_5MoeForCausalLM.text_model_cls.layer_cls.__name__ == "Qwen3_5MoeDecoderLayer"


def test_activation_checkpointing_keeps_grads_and_aux() -> None:
    from hyperpar.distributed.activation_checkpoint import wrap_block

    hf = make_hf(TINY)
    plain = ours_from_hf(hf, tiny(mtp_num_hidden_layers=0))
    results = []
    for mode in ("none", "full", "selective"):
        m = copy.deepcopy(plain)
        if mode != "none":
            for key, block in list(m.model.layers.items()):
                m.model.layers[key] = wrap_block(block, mode)
        out = m(ids_for(24))
        (out.logits.square().mean() + out.aux_loss).backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in m.named_parameters()}
        results.append((out.aux_loss.detach(), grads))
    (a0, g0) = results[0]
    for a, g in results[1:]:
        assert torch.equal(a, a0)
        for n in g0:
            assert (g[n] - g0[n]).abs().max().item() <= 1e-6, n


# --- vision-language: Qwen3_5MoeForConditionalGeneration ------------------------------------------

TINY_VL = qwen3_5_moe_vl()  # tiny_configs/qwen3_5_moe_vl.json (tests/fixtures.py)


def make_hf_vl(cfg: dict = TINY_VL, seed: int = 0):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    return perturb_(Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**copy.deepcopy(cfg))).float().train(), seed + 1)


def vl_from_hf(hf, cfg: dict = TINY_VL, **changes):
    from hyperpar.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeVLArgs, Qwen3_5MoeVLStateDictAdapter

    args = Qwen3_5MoeVLArgs.from_hf_config(cfg)
    if changes:
        args = args.replace(**changes)
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    sd = hf.state_dict()
    adapter = Qwen3_5MoeVLStateDictAdapter(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(adapter.load_param(name, sd.__getitem__))
    return model.train()


def vl_batches() -> dict[str, dict[str, torch.Tensor]]:
    """MODELS.md 14's verification inputs: text, image (two rows), video (one row)."""
    g = torch.Generator().manual_seed(0)
    text_ids = torch.randint(0, 900, (2, 24), generator=g)
    rows = []
    for _ in range(2):
        t = torch.randint(0, 900, (16,), generator=g)
        rows.append(torch.cat([t[:3], torch.tensor([1002] + [1000] * 6 + [1003]), t[3:]]))
    img_ids = torch.stack(rows)
    img_labels = img_ids.masked_fill(img_ids == 1000, -100)
    vid = [5, 6, 7]
    for grp in range(2):
        vid += [100 + grp, 101 + grp, 1002] + [1001] * 4 + [1003]
    vid_ids = torch.tensor([vid + [8, 9, 10]])
    return {
        "text": {"input_ids": text_ids, "labels": text_ids},
        "image": {
            "input_ids": img_ids, "labels": img_labels,
            "pixel_values": torch.randn(48, 1536, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 6], [1, 6, 4]]),
            "mm_token_type_ids": (img_ids == 1000).to(torch.int32),
        },
        "video": {
            "input_ids": vid_ids, "labels": vid_ids.masked_fill(vid_ids == 1001, -100),
            "pixel_values_videos": torch.randn(32, 1536, generator=g),
            "video_grid_thw": torch.tensor([[2, 4, 4]]),
            "mm_token_type_ids": (vid_ids == 1001).to(torch.int32) * 2,
        },
    }


@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_vl_matches_transformers(kind: str) -> None:
    hf = make_hf_vl()
    ours = vl_from_hf(hf)
    batch = vl_batches()[kind]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ref = hf(**inputs, labels=batch["labels"], use_cache=False, output_router_logits=True)
    out = ours(**inputs)
    assert out.logits.shape == ref.logits.shape and out.mtp_logits is None
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    coef = TINY["router_aux_loss_coef"]
    assert abs(out.aux_loss.item() / coef - ref.aux_loss.item()) <= 1e-5
    labels = torch.full_like(batch["labels"], -100)
    labels[:, :-1] = batch["labels"][:, 1:]
    lm = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_lm = ref.loss - coef * ref.aux_loss
    assert abs(lm.item() - ref_lm.item()) <= 1e-5
    if kind != "text":  # gradients reach the vision tower like transformers'
        ref.loss.backward()
        (lm + out.aux_loss).backward()
        hf_params = dict(hf.named_parameters())
        for name, g in hf_named_grads(ours).items():
            if name.startswith("model.visual.") and hf_params[name].grad is not None:
                assert (g - hf_params[name].grad).abs().max().item() <= 1e-5, name


def test_vl_export_import_and_text_family_reads_vl_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from hyperpar.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    hf = make_hf_vl(seed=3)
    ours = vl_from_hf(hf)
    batch = vl_batches()["image"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        mine = ours(**inputs).logits
    to_hf(ours, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    hf_sd = reloaded.state_dict()
    for name, t in hf_state_dict(ours).items():
        assert torch.equal(hf_sd[name], t), name
    with torch.no_grad():
        assert (reloaded(**inputs, use_cache=False).logits - mine).abs().max().item() <= 1e-5
    again = from_hf(tmp_path / "ours")  # a qwen3_5_moe VL directory builds the VL model
    assert isinstance(again, Qwen3_5MoeForConditionalGeneration)
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, mine)

    # transformers' own save (per-expert keys) read by the text family: text-only logits agree
    hf.save_pretrained(str(tmp_path / "hf"))
    from hyperpar.distributed.materialize import materialize
    from hyperpar.models.build import ModelBuilder

    builder = ModelBuilder(name="qwen3_5_moe", hf_path=str(tmp_path / "hf"), text_only=True)
    text_model = materialize(builder.build_meta(), torch.device("cpu"), seed=0, source=builder.weight_source())
    ids = vl_batches()["text"]["input_ids"]
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        assert (text_model(ids).logits - ref).abs().max().item() <= 1e-5
        assert (ours(ids).logits - ref).abs().max().item() <= 1e-5


def test_vl_mtp_and_debug_flavour() -> None:
    from hyperpar.models.qwen3_5_moe import VL_FLAVORS, Qwen3_5MoeForConditionalGeneration

    cfg = copy.deepcopy(TINY_VL)
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    hf = make_hf_vl()
    sd = {**hf.state_dict(), **mtp_tensors(TINY, hf, prefix="model.language_model.layers.1.")}
    hf_like = type("SD", (), {"state_dict": lambda self: sd})()
    model = vl_from_hf(hf_like, cfg, mtp_loss_weight=0.5)
    batch = vl_batches()["image"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    assert out.mtp_logits.shape == (2, 23, 1024)
    with torch.no_grad():
        ref = hf(**inputs, use_cache=False).logits
    assert (out.logits - ref).abs().max().item() <= 1e-5
    assert vl_from_hf(hf_like, cfg)(**inputs).mtp_logits is None

    args = VL_FLAVORS["debug"]
    with torch.device("meta"):
        m = Qwen3_5MoeForConditionalGeneration(args)
    assert m.model.visual is not None and m.mtp is not None
    assert not args.vision.deepstack_visual_indexes and args.vision.out_hidden_size == args.text.hidden_size
    assert get_model_spec("qwen3_5_moe_vl").default_data == "vl_dummy"
