"""Tensor (+ sequence, loss) parallelism: every family's gradient under tp layouts equals one
process's, parameter by parameter; an unusual HF checkpoint loads rank-locally and trains; a
parity sweep through the CLI holds per step; checkpoints cross layouts; exports reload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import qwen3_5 as tiny_qwen3_5
from helpers import cli_env, records, run_cli
from layout_grads import assert_same_step, layout_grads, max_rel_grad_diff

# One step, global batch 4 of 32 tokens, 2 micro-batches per rank on 1 data-parallel rank.
STEP = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1"]


def _compare(model: str, layout: str, world: int, extra: list[str] = ()) -> None:
    base = [f"model={model}", *STEP, *extra]
    ref = layout_grads(["parallel=single", *base], 1)
    got = layout_grads([f"parallel={layout}", *base], world)
    assert_same_step(ref, got, f"{model} {layout} {' '.join(extra)}")


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl",
                                   pytest.param("qwen3_5_moe_vl", marks=pytest.mark.full), "qwen3_vl_moe"])
def test_tp2_gradients_equal_one_process(model: str) -> None:
    extra = ["model.mtp_loss_weight=0.3"] if model in ("qwen3_5_moe", "qwen3_5_moe_vl") else []
    _compare(model, "tp2", 2, extra)


@pytest.mark.parametrize(
    ("model", "layout", "world", "extra"),
    [
        ("qwen3_5_moe", "fsdp_tp2", 4, ["model.mtp_loss_weight=0.3"]),  # FSDP over a TP-sharded model, MTP on
        ("qwen3_vl_moe", "hsdp2_tp2", 4, ["parallel.vision_tp=true"]),  # replicate x tp, vision tower TP'd
        ("qwen3_5", "fsdp2_tp2_nosp", 4, []),  # replicated residual stream (no SP)
        ("qwen3_5_moe", "tp2", 2, ["train.activation_checkpoint=selective"]),  # AC recomputes TP collectives
        # dp_replicate 2 x dp_shard 2 x tp 2 on one mesh (8 ranks; global batch 8 so every DP rank has data)
        pytest.param("qwen3_5", "hsdp2x2_tp2", 8, ["train.global_batch_size=8"], marks=pytest.mark.full),
    ],
)
def test_tp_combinations_gradients_equal_one_process(model: str, layout: str, world: int, extra: list[str]) -> None:
    _compare(model, layout, world, extra)


@pytest.mark.parametrize(("model", "layout", "world", "extra"), [
    # tied: the embedding and head share one unevenly split tensor (rows 1024 + 1023); MLP 51 + 50
    ("qwen3_5", "tp2", 2, ["+model.overrides.tie_word_embeddings=true", "+model.overrides.intermediate_size=101"]),
    # VL: the embedding's output is all-reduced whole before the vision merge; FSDP over the uneven
    # split; the dense MLP of layer 2 (mlp_only_layers) split 51 + 50
    ("qwen3_vl_moe", "fsdp_tp2", 4, ["+model.overrides.intermediate_size=101"]),
    # the shared expert and every routed expert split 17 + 16 (grouped GEMMs on shards of their own), MTP on
    ("qwen3_5_moe", "tp2", 2, ["+model.overrides.shared_expert_intermediate_size=33",
                               "+model.overrides.moe_intermediate_size=33", "model.mtp_loss_weight=0.3"]),
    # routed experts 17 + 16 over tp inside each ep group, FSDP over both
    pytest.param("qwen3_5_moe", "fsdp2_tp2_ep2", 4, ["+model.overrides.moe_intermediate_size=33"], marks=pytest.mark.full),
])
def test_sizes_not_divisible_by_tp(model: str, layout: str, world: int, extra: list[str]) -> None:
    """A vocabulary of 2047 and MLP widths that tp 2 does not divide, split as torch.chunk does (no
    padding): every gradient equals one process's."""
    _compare(model, layout, world, ["+model.overrides.vocab_size=2047", *extra])


@pytest.mark.parametrize(("model", "layout", "world", "extra"), [
    # 1 KV head: both ranks compute it and keep it for their query heads
    ("qwen3_5", "tp2", 2, ["+model.overrides.num_key_value_heads=1"]),
    # 6 heads, 3 KV heads: rank 0's query heads read KV heads 0, 0, 1 and rank 1's 1, 2, 2 (one per query
    # head); GatedDeltaNet's 3 key heads for 6 value heads the same way; the MTP layer's attention too
    ("qwen3_5_moe", "tp2", 2, ["+model.overrides.num_attention_heads=6", "+model.overrides.num_key_value_heads=3",
                               "+model.overrides.head_dim=32", "+model.overrides.linear_num_key_heads=3",
                               "+model.overrides.linear_num_value_heads=6", "+model.overrides.linear_value_head_dim=32",
                               "model.mtp_loss_weight=0.3"]),
    # 3 key heads for 12 value heads over tp 2 (one per value head), then Ulysses over cp 2, packed documents
    pytest.param("qwen3_5", "tp2_cp2", 4, ["+model.overrides.linear_num_key_heads=3",
                                           "+model.overrides.linear_num_value_heads=12",
                                           "+model.overrides.linear_value_head_dim=16", "data=json"],
                 marks=pytest.mark.full),
    # 12 heads, 3 KV heads over tp 2 (0 0 0 0 1 1 | 1 1 2 2 2 2), then Ulysses over cp 2 on each tp rank's 6
    pytest.param("qwen3_vl_moe", "tp2_cp2", 4, ["+model.overrides.num_attention_heads=12",
                                                "+model.overrides.num_key_value_heads=3", "+model.overrides.head_dim=16"],
                 marks=pytest.mark.full),
])
def test_kv_heads_tp_does_not_divide_are_replicated(model: str, layout: str, world: int, extra: list[str]) -> None:
    """KV heads tp does not divide: every rank computes them all and keeps those its query heads read
    (tensor_parallel.heads_read); the k/v weights' gradients are summed over tp."""
    _compare(model, layout, world, extra)


@pytest.mark.parametrize(("heads", "kv", "tp", "read"), [
    (8, 2, 4, [[0], [0], [1], [1]]),  # fewer KV heads than tp: one each, GQA on the rank
    (8, 1, 2, [[0], [0]]),
    (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # a KV head shared by two ranks' query heads: one per query head
    (12, 3, 2, [[0, 0, 0, 0, 1, 1], [1, 1, 2, 2, 2, 2]]),
])
def test_heads_read(heads: int, kv: int, tp: int, read: list[list[int]]) -> None:
    from hyperpar.distributed.tensor_parallel import heads_read

    assert [heads_read(heads, kv, tp, r) for r in range(tp)] == read


def _unusual_checkpoint(path: Path) -> dict:
    """An HF Qwen3.5 checkpoint with an odd geometry (saved by transformers): 1 KV head, 6 query
    heads, untied, 3 layers L F L, dk 24 ≠ dv 16, hidden 96, vocab 1001 (split 501 + 500 under tp 2)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = tiny_qwen3_5(hidden_size=96, num_attention_heads=6, num_key_value_heads=1, head_dim=16, intermediate_size=160,
                       linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=16,
                       num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                       vocab_size=1001, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).save_pretrained(str(path))
    return cfg


def test_hf_checkpoint_loads_rank_locally_and_trains_under_tp2(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _unusual_checkpoint(ckpt)
    base = [f"model.hf_path={ckpt}", *STEP]
    ref = layout_grads(["parallel=single", *base], 1)
    got = layout_grads(["parallel=tp2", *base], 2)
    diff, where = max_rel_grad_diff(ref, got)
    full = ref["load"]["local_param_bytes"]
    local, read = got["load"]["local_param_bytes"], got["load"]["read_bytes"]
    peak = local + got["load"]["max_read_bytes"]
    print(f"rank-local HF load under tp2: full model {full / 1e6:.3f} MB; rank 0 holds {local / 1e6:.3f} MB "
          f"({local / full:.2f}), read {read / 1e6:.3f} MB, peak resident {peak / 1e6:.3f} MB ({peak / full:.2f} of full)")
    assert abs(ref["loss"] - got["loss"]) <= 1e-5 and diff <= 1e-5, where
    assert read == local  # every byte read is a byte kept: no full tensor of a sharded parameter
    assert peak <= 0.6 * full


def test_moe_hf_checkpoint_with_uneven_experts_loads_rank_locally_under_tp2(tmp_path: Path) -> None:
    """A Qwen3.5-MoE checkpoint whose expert width tp 2 does not divide (33: 17 + 16 of each fused
    gate_up half and of down_proj, read as boxes of the fused tensors): same gradients as one process
    from the same weights, every byte read kept."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from fixtures import qwen3_5_moe

    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_moe(moe_intermediate_size=33))).save_pretrained(str(ckpt))
    base = ["model=qwen3_5_moe", f"model.hf_path={ckpt}", *STEP]
    ref = layout_grads(["parallel=single", *base], 1)
    got = layout_grads(["parallel=tp2", *base], 2)
    assert_same_step(ref, got, "uneven experts from HF under tp2")
    assert got["load"]["read_bytes"] == got["load"]["local_param_bytes"]


def _cli(run_dir: Path, args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    res = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


RUN = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1", "launch.threads_per_rank=1",
       "train.steps=8"]


# CI budget: qwen3_vl_moe under tp runs in CI inside tests/test_pipeline.py (tp2_pp2).
@pytest.mark.full
def test_parity_sweep_tp_layouts_vl_moe(tmp_path: Path) -> None:
    """The headline: qwen3_vl_moe (images and videos) under tp2, fsdp_tp2 and hsdp2_tp2 matches single
    per step through the CLI's parity sweep (which exits non-zero on any miss)."""
    sweep = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "hyperpar", "-m", "model=qwen3_vl_moe",
                          "parallel=single,tp2,fsdp_tp2,hsdp2_tp2", "+experiment=parity", *RUN,
                          f"hydra.sweep.dir={sweep}", "parity.tolerance_step=1e-5"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((sweep / "parity.json").read_text())
    print((sweep / "parity.md").read_text())
    assert report


# CI budget: a tp checkpoint resumed under single and its export run in CI in tests/test_pipeline.py
# (the 8-process dp_shard 2 x tp 2 x pp 2 test).
@pytest.mark.full
def test_checkpoint_crosses_tp_layouts_and_export_reloads(tmp_path: Path) -> None:
    """Saved under fsdp_tp2 at step 4, resumed under single and fsdp2, and single's resumed under
    fsdp_tp2: steps 5-8 equal an uninterrupted single run; the TP run's HF export at the end reloads
    in transformers with logits equal to ours."""
    ck = ["checkpoint=default", "checkpoint.save_steps=4"]
    ref = tmp_path / "ref"
    _cli(ref, ["parallel=single", *RUN])
    tp = tmp_path / "tp"
    _cli(tp, ["parallel=fsdp_tp2", *RUN, *ck, "train.stop_after_steps=4"])
    step4 = tp / "checkpoints" / "step_4"
    assert step4.is_dir()
    want = records(ref)
    for layout in ("single", "fsdp2"):
        run = tmp_path / f"resume_{layout}"
        _cli(run, [f"parallel={layout}", *RUN, *ck, f"checkpoint.load_path={step4}"])
        got = records(run)
        for s in range(5, 9):
            assert abs(got[s]["loss"] - want[s]["loss"]) <= 1e-5, (layout, s)
    # and the other way round: single's step-4 checkpoint resumed under fsdp_tp2
    one = tmp_path / "one"
    _cli(one, ["parallel=single", *RUN, *ck, "train.stop_after_steps=4"])
    back = tmp_path / "back"
    _cli(back, ["parallel=fsdp_tp2", *RUN, *ck, f"checkpoint.load_path={one / 'checkpoints' / 'step_4'}",
                "checkpoint.export_hf_at_end=true"])
    got = records(back)
    for s in range(5, 9):
        assert abs(got[s]["loss"] - want[s]["loss"]) <= 1e-5, s
    _export_reloads(back)  # written live by the fsdp_tp2 ranks (full tensors gathered from DTensors)


def _export_reloads(run: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hyperpar.models import from_hf

    hf_dir = next(run.glob("**/hf"), None) or run / "hf"
    assert (hf_dir / "config.json").is_file(), list(run.iterdir())
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = from_hf(hf_dir).eval()
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ours(ids)
        diff = (hf(input_ids=ids, use_cache=False).logits - getattr(out, "logits", out)).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.full  # CI keeps the bf16 single-vs-fsdp2 run (test_bf16_parity.py)
def test_bf16_vl_moe_single_vs_fsdp_tp2_100_steps(tmp_path: Path) -> None:
    """bf16 params, fp32 reduce: the mean loss over 100 steps of fsdp_tp2 is within 5e-3 of single's."""
    bf16 = ["model=qwen3_vl_moe", "train.mixed_precision.param_dtype=bfloat16", "train.steps=100",
            "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1", "launch.threads_per_rank=1"]
    means = []
    for layout in ("single", "fsdp_tp2"):
        run = tmp_path / layout
        _cli(run, [f"parallel={layout}", *bf16], timeout=1800)
        losses = [r["loss"] for r in records(run).values()]
        assert len(losses) == 100
        means.append(sum(losses) / len(losses))
    print(f"bf16 qwen3_vl_moe mean loss over 100 steps: single {means[0]:.5f}, fsdp_tp2 {means[1]:.5f}, "
          f"diff {abs(means[0] - means[1]):.2e}")
    assert abs(means[0] - means[1]) <= 5e-3
