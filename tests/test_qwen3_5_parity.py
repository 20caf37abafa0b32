"""Qwen3.5 dense: logits / loss / gradients equal to transformers' Qwen3_5ForCausalLM (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fixtures import qwen3_5 as tiny
from hyperpar.errors import ConfigError
from hyperpar.models.qwen3_5 import FLAVORS, Qwen3_5Args, Qwen3_5ForCausalLM, Qwen3_5StateDictAdapter
from hyperpar.models.spec import get_model_spec, spec_for_hf_model_type

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

TINY = tiny()  # tiny_configs/qwen3_5_causal_lm.json (tests/fixtures.py)


def make_hf(cfg: dict, seed: int = 0):
    """transformers model with non-trivial norms and decays (zero-init offset norms would hide bugs)."""
    from transformers import Qwen3_5ForCausalLM as HFModel
    from transformers import Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = HFModel(Qwen3_5TextConfig(**cfg)).float().train()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def ours_from_hf(hf, cfg: dict) -> Qwen3_5ForCausalLM:
    """Our model built on meta, materialised, and loaded through the adapter from HF's state dict."""
    args = Qwen3_5Args.from_hf_config(cfg)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    sd = hf.state_dict()
    adapter = Qwen3_5StateDictAdapter(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(adapter.load_param(name, sd.__getitem__))
    return model.train()


def ids_for(S: int, B: int = 2) -> torch.Tensor:
    return torch.randint(0, 900, (B, S), generator=torch.Generator().manual_seed(0))


def positions(kind: str, B: int, S: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "2d":  # (B, S) with a per-row offset
        return torch.arange(S).unsqueeze(0) + torch.tensor([[0], [5]])[:B]
    t = torch.arange(S)
    thw = torch.stack([t, t // 2 + 1, (t * 7) % 11]).unsqueeze(1).expand(3, B, S)  # distinct T/H/W rows
    if kind == "3d":
        return thw.contiguous()
    return torch.cat([t.expand(1, B, S), thw], dim=0)  # "4d": text row + T/H/W


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("S", [24, 70])
def test_logits_match_transformers(tied: bool, S: int) -> None:
    cfg = tiny(tie_word_embeddings=tied)
    hf = make_hf(cfg)
    ours = ours_from_hf(hf, cfg)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = ids_for(S)
    with torch.no_grad():
        for kind in ("none", "2d", "3d", "4d"):
            pos = positions(kind, 2, S)
            ref = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
            got = ours(ids, pos)
            assert got.shape == ref.shape == (2, S, cfg["vocab_size"])
            assert (got - ref).abs().max().item() <= 1e-5, kind


def test_full_rotary_and_more_layers() -> None:
    cfg = tiny(
        tie_word_embeddings=False,
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0, "mrope_section": [11, 11, 10]},
    )
    hf = make_hf(cfg, seed=3)
    ours = ours_from_hf(hf, cfg)
    ids = ids_for(40)
    pos = positions("3d", 2, 40)
    with torch.no_grad():
        diff = (ours(ids, pos) - hf(input_ids=ids, position_ids=pos, use_cache=False).logits).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_loss_and_grads_match_transformers(tied: bool) -> None:
    cfg = tiny(tie_word_embeddings=tied)
    hf = make_hf(cfg, seed=1)
    ours = ours_from_hf(hf, cfg)
    ids = ids_for(70)
    ref_loss = hf(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # pre-shifted: position t predicts t+1
    logits = ours(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    # every parameter learns
    assert all(p.grad is not None for p in ours.parameters())
    hf_params = dict(hf.named_parameters())
    # Our gradients under the checkpoint's names (split GatedDeltaNet weights fused back).
    from hyperpar.models.fused import join_parts
    from hyperpar.models.qwen3_5.state_dict import Qwen3_5StateDictAdapter

    adapter = Qwen3_5StateDictAdapter(ours.args)
    ours_grads = dict(join_parts(kv for n, p in ours.named_parameters() for kv in adapter.export_param(n, p.grad).items()))
    assert set(ours_grads) == set(hf_params)
    for name, g in ours_grads.items():
        g_ref = hf_params[name].grad
        assert g_ref is not None, name
        assert (g - g_ref).abs().max().item() <= 1e-5, name


def test_bf16_close_to_transformers() -> None:
    cfg = tiny(tie_word_embeddings=False)
    hf = make_hf(cfg, seed=2)
    ours = ours_from_hf(hf, cfg)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = ids_for(70)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        got = ours(ids)
    assert got.dtype == torch.bfloat16
    # Measured 0.0059 (max |logit| 0.80; torch 2.13 CPU, seeds 2-5: 0.0059-0.0068): 2x that.
    assert (got.float() - ref.float()).abs().max().item() <= 0.012
    assert torch.isfinite(got).all()


def test_meta_init_is_a_function_of_seed_and_name() -> None:
    args = FLAVORS["debug"]

    def build(seed: int) -> Qwen3_5ForCausalLM:
        with torch.device("meta"):
            m = Qwen3_5ForCausalLM(args)
        m.to_empty(device="cpu")
        m.init_buffers()
        for i, (name, p) in enumerate(m.named_parameters()):
            full = torch.empty(p.shape, dtype=torch.float32)
            m.init_param(name, full, torch.Generator().manual_seed(seed * 1000 + i))
            with torch.no_grad():
                p.copy_(full)
        return m

    a, b = build(0), build(0)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    sd = a.state_dict()
    assert torch.all(sd["model.norm.weight"] == 0)  # offset norm: 0 means scale 1
    assert torch.all(sd["model.layers.1.self_attn.q_norm.weight"] == 0)
    assert torch.all(sd["model.layers.0.linear_attn.norm.weight"] == 1)  # gated norm is plain
    assert torch.all(sd["model.layers.0.linear_attn.dt_bias"] == 1)
    a_log = sd["model.layers.0.linear_attn.A_log"]
    assert torch.all((a_log >= torch.log(torch.tensor(0.01))) & (a_log <= torch.log(torch.tensor(16.0))))
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025
    inv = a.model.rotary_emb.inv_freq
    assert inv.dtype == torch.float32 and inv.device.type == "cpu" and torch.isfinite(inv).all()
    ids = torch.randint(0, args.vocab_size, (2, 33))
    assert torch.isfinite(a(ids)).all()


def test_tied_weights_survive_to_empty() -> None:
    args = FLAVORS["debug"].replace(tie_word_embeddings=True)
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(args)
    m.to_empty(device="cpu")
    m.init_buffers()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(m.named_parameters())


def test_pipeline_style_split_runs_on_what_is_left() -> None:
    cfg = tiny(tie_word_embeddings=False)
    hf = make_hf(cfg)
    full = ours_from_hf(hf, cfg)
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    del first.model.layers["2"], first.model.layers["3"]
    first.model.norm = None
    first.lm_head = None
    del second.model.layers["0"], second.model.layers["1"]
    second.model.embed_tokens = None
    ids = ids_for(24)
    pos = positions("3d", 2, 24)
    with torch.no_grad():
        h = first(ids, pos)
        assert h.shape == (2, 24, cfg["hidden_size"])
        assert torch.equal(second(h, pos), full(ids, pos))


def test_debug_flavour_trains() -> None:
    args = FLAVORS["debug"]
    n = sum(p.numel() for p in Qwen3_5ForCausalLM(args).parameters())
    assert 1_000_000 <= n <= 3_000_000
    assert set(args.layer_types[:2]) == set(args.layer_types[2:]) == {"linear_attention", "full_attention"}
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, args.vocab_size, (4, 64))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name,lo,hi", [("0.8b", 0.7e9, 0.8e9), ("4b", 4.0e9, 4.4e9), ("9b", 8.7e9, 9.2e9), ("27b", 26e9, 28e9)])
def test_real_flavours_build_on_meta(name: str, lo: float, hi: float) -> None:
    args = FLAVORS[name]
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(args)
    n = sum(p.numel() for p in m.parameters())
    assert lo <= n <= hi
    assert args.tie_word_embeddings == (name in ("0.8b", "4b"))
    assert args.layer_types[3] == "full_attention" and args.layer_types[0] == "linear_attention"
    assert args.rotary_dim == 64 and args.rope_theta == 1e7 and args.vocab_size == 248320
    assert m.flops_per_token(4096) > 6 * (n - args.vocab_size * args.hidden_size)


def test_hf_config_round_trip_and_variants() -> None:
    from transformers import Qwen3_5TextConfig

    args = Qwen3_5Args.from_hf_config(TINY)
    assert args.layer_types == TINY["layer_types"] and args.rotary_dim == 16 and args.mrope_section == [3, 3, 2]
    out = args.to_hf_config()
    assert out["model_type"] == "qwen3_5_text" and out["architectures"] == ["Qwen3_5ForCausalLM"]
    assert Qwen3_5Args.from_hf_config(out) == args
    hf_cfg = Qwen3_5TextConfig(**out)
    assert hf_cfg.layer_types == args.layer_types and hf_cfg.rope_parameters["rope_theta"] == 1e7

    # composite VL config: text_config nested, tying from the top level
    text = {k: v for k, v in TINY.items() if k not in ("architectures", "tie_word_embeddings")}
    vl = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True, "vision_config": {}}
    assert Qwen3_5Args.from_hf_config(vl) == args

    # legacy top-level rope keys, no layer_types → full_attention_interval
    legacy = {k: v for k, v in TINY.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e7, full_attention_interval=2, num_hidden_layers=4)
    la = Qwen3_5Args.from_hf_config(legacy)
    assert la.layer_types == ["linear_attention", "full_attention"] * 2
    assert la.partial_rotary_factor == 0.25 and la.mrope_section == [11, 11, 10] and la.rope_theta == 1e7

    with pytest.raises(ConfigError):
        Qwen3_5Args.from_hf_config(tiny(layer_types=["linear_attention"]))
    with pytest.raises(ConfigError):
        Qwen3_5Args.from_hf_config(tiny(num_key_value_heads=3))


def test_spec_registered() -> None:
    spec = get_model_spec("qwen3_5")
    assert spec_for_hf_model_type("qwen3_5_text") is spec and spec_for_hf_model_type("qwen3_5") is spec
    assert spec.model_cls is Qwen3_5ForCausalLM and spec.args_cls is Qwen3_5Args
    assert set(spec.flavors) >= {"debug", "0.8b", "4b", "9b", "27b"}
    assert callable(spec.parallelize)
    assert Qwen3_5ForCausalLM.text_model_cls.layer_cls.__name__ == "Qwen3_5DecoderLayer"


def test_activation_checkpointing_wrapped_blocks() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = tiny(tie_word_embeddings=False)
    hf = make_hf(cfg)
    plain = ours_from_hf(hf, cfg)
    wrapped = copy.deepcopy(plain)
    for key, block in list(wrapped.model.layers.items()):
        assert isinstance(block, Qwen3_5ForCausalLM.text_model_cls.layer_cls)
        wrapped.model.layers[key] = checkpoint_wrapper(block)
    ids = ids_for(40)
    for m in (plain, wrapped):
        m(ids).square().mean().backward()
    wrapped_params = dict(wrapped.named_parameters())
    by_plain_name = {n.replace("_checkpoint_wrapped_module.", ""): q for n, q in wrapped_params.items()}
    assert set(by_plain_name) == set(dict(plain.named_parameters()))
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, by_plain_name[name].grad), name
    # init_param resolves names that carry the wrapper segment
    name = next(n for n in wrapped_params if "_checkpoint_wrapped_module" in n and n.endswith("A_log"))
    full = torch.empty(wrapped_params[name].shape)
    wrapped.init_param(name, full, torch.Generator().manual_seed(0))
    assert torch.all(full <= torch.log(torch.tensor(16.0)))
