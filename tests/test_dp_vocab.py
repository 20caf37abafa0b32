"""parallel.fsdp_vocab_parallel: the embedding and head sharded by vocabulary over the FSDP ranks
(distributed/dp_vocab.py) compute one process's loss and gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures import CKPT
from helpers import cli_small, close_group, compose_cfg, exit_spawned_rank, free_port, read_losses, run_cli
from layout_grads import assert_layout_matches_single

WORLD = 3
VOCAB = 37  # torch.chunk over 3 ranks: 13 + 13 + 11 rows
HIDDEN = 8


def _rows(rank: int) -> int:
    return 5 + 4 * rank  # the ranks hold different token counts: 5, 9, 13


def _batch():
    """Every rank's tokens, hidden states and labels (some ignored), and the head weight, in full."""
    g = torch.Generator().manual_seed(0)
    total = sum(_rows(r) for r in range(WORLD))
    ids = torch.randint(0, VOCAB, (total,), generator=g)
    hidden = torch.randn(total, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (total,), generator=g)
    labels[::4] = -100
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    return ids, hidden, labels, weight


def _own(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(_rows(r) for r in range(rank))
    return t[start:start + _rows(rank)]


def _kernel_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyperpar.distributed import dp_vocab
    from hyperpar.train.cross_entropy import linear_cross_entropy_sum

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ids, hidden, labels, weight = _batch()
        tokens = (labels != -100).sum().float()
        report = {}
        for upstream in (1.0, 2.5):  # the real gradient equals the hint / is 2.5x it (rescaled in backward)
            # reference: one process, the whole batch
            h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            ref = linear_cross_entropy_sum(h_ref, w_ref, labels, 1.0 / tokens)
            (ref / tokens * upstream).backward()
            # sharded: this rank's tokens, its vocabulary rows
            w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
            h = _own(hidden, rank).clone().requires_grad_()
            loss = dp_vocab.sharded_linear_cross_entropy_sum(h, w, _own(labels, rank), 1.0 / tokens)
            (loss / tokens * upstream).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            report[f"loss_{upstream}"] = (total - ref.detach()).abs().item() / ref.abs().item()
            report[f"dh_{upstream}"] = (h.grad - _own(h_ref.grad, rank)).abs().max().item()
            report[f"dw_{upstream}"] = (w.grad.full_tensor() - w_ref.grad).abs().max().item()
        # 16-bit compute: GEMMs in fp32 on the bf16 values (cpu_matmul=fp32) or in bf16 (native), logits and
        # their gradient rounded to bf16: against fp64 on the bf16-rounded inputs
        from hyperpar.models.layers import cpu_matmul

        h16, w16 = hidden.bfloat16(), weight.bfloat16()
        h64, w64 = h16.double().requires_grad_(), w16.double().requires_grad_()
        (torch.nn.functional.cross_entropy(h64 @ w64.t(), labels, ignore_index=-100, reduction="sum") / tokens).backward()
        for policy in ("fp32", "native"):
            before = cpu_matmul.set_policy(policy)
            try:
                w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
                h = _own(h16, rank).clone().requires_grad_()
                loss = dp_vocab.sharded_linear_cross_entropy_sum(h, w, _own(labels, rank), 1.0 / tokens)
                (loss / tokens).backward()
            finally:
                cpu_matmul.set_policy(before)
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            ref = h64.grad.float()
            report[f"bf16_{policy}_dtypes_ok"] = float(h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32)
            ce = torch.nn.functional.cross_entropy(h64 @ w64.t(), labels, ignore_index=-100, reduction="sum").item()
            report[f"bf16_{policy}_loss"] = abs(total.item() - ce) / ce
            report[f"bf16_{policy}_dh"] = ((h.grad.float() - _own(ref, rank)).abs().max() / ref.abs().max()).item()
            report[f"bf16_{policy}_dw"] = ((w.grad.full_tensor() - w64.grad.float()).abs().max() / w64.grad.abs().max()).item()
        # the embedding: lookup and gradient
        emb = torch.nn.Embedding(VOCAB, HIDDEN)
        emb.weight = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        emb._hyperpar_dp_vocab = True
        emb.__class__ = dp_vocab.VocabShardedEmbedding
        mine = _own(ids, rank).view(1, -1)
        vec = emb(mine)
        upstream = torch.randn(len(ids), HIDDEN, generator=torch.Generator().manual_seed(5))
        (vec.view(-1, HIDDEN) * _own(upstream, rank)).sum().backward()
        w_ref = weight.clone().requires_grad_()
        ref = torch.nn.functional.embedding(ids, w_ref)
        (ref * upstream).sum().backward()
        report["lookup"] = (vec.view(-1, HIDDEN) - _own(ref, rank)).abs().max().item()
        report["lookup_shape_ok"] = float(vec.shape == (1, _rows(rank), HIDDEN))
        report["lookup_dw"] = (emb.weight.grad.full_tensor() - w_ref.grad).abs().max().item()
        # upstream gradients in different ratios to their hints: refused on every rank
        w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        loss = dp_vocab.sharded_linear_cross_entropy_sum(_own(hidden, rank).clone().requires_grad_(), w,
                                                         _own(labels, rank), torch.tensor(1.0))
        try:
            (loss * (1.0 + rank)).backward()
            report["ratio_refused"] = 0.0
        except RuntimeError as e:
            report["ratio_refused"] = float("different ratios" in str(e))
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    except BaseException:
        close_group(ok=False)
        raise
    exit_spawned_rank()


def test_sharded_head_and_lookup_equal_one_process(tmp_path):
    """Uneven token counts per rank, uneven vocabulary shards, ignored labels: the summed loss, each
    rank's hidden-state gradient and the whole weight gradient equal the one-process fused head's;
    the lookup and its gradient equal ``F.embedding``'s. bf16 hidden states (GEMMs in fp32 on the bf16
    values, or in bf16): within bf16 rounding of fp64 on the same values, the weight's gradient fp32."""
    import torch.multiprocessing as mp

    mp.spawn(_kernel_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for r in range(WORLD):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep.pop("lookup_shape_ok") == 1.0 and rep.pop("ratio_refused") == 1.0, rep
        half = {k: rep.pop(k) for k in list(rep) if k.startswith("bf16_")}
        assert all(half.pop(f"bf16_{p}_dtypes_ok") == 1.0 for p in ("fp32", "native")), half
        assert all(v <= 2e-2 for v in half.values()), (r, half)  # bf16 rounding of logits and gradients
        assert rep.pop("lookup") == 0.0, rep  # one rank contributes each vector, the others exact zeros
        assert all(v <= 1e-6 for v in rep.values()), (r, rep)


# ---- one training step of the real worker pieces ------------------------------------------------------

STEP = ["train.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.fsdp_vocab_parallel=true"]


@pytest.mark.parametrize(("model", "extra", "layout", "world", "tol"), [
    # untied, MTP (the head and the embedding called twice), aux loss, two micro-batches per rank
    ("qwen3_5_moe", ["model.mtp_loss_weight=0.3"], "fsdp2", 2, 1e-5),
    # tied (one parameter, both gradients), over 4 ranks: one micro-batch each
    ("qwen3_5", ["+model.overrides.tie_word_embeddings=true"], "fsdp4", 4, 1e-5),
    # HSDP: sharded over dp_shard, the gradients summed over the 2 replicas (reduce_replicas)
    ("qwen3_5_moe", ["model.mtp_loss_weight=0.3"], "hsdp2x2", 4, 1e-5),
    # bf16 compute against the one-rank bf16 step: the embedding's and head's weight gradients are summed
    # in fp32 here (FSDP rounds each rank's to bf16 first), so within bf16 rounding
    ("qwen3_5", ["train.mixed_precision.param_dtype=bfloat16"], "fsdp2", 2, 2e-3),
    # context parallel: FSDP's axis is dp_shard x cp, each rank a shard of the rows (the cut labels, the MTP stream)
    ("qwen3_5_moe", ["model.mtp_loss_weight=0.3"], "cp2", 2, 1e-5),
    pytest.param("qwen3_5_moe", [], "fsdp2_cp2_ep2", 4, 1e-5, marks=pytest.mark.full),
    pytest.param("qwen3_vl_moe", ["data=vl_dummy"], "fsdp2", 2, 1e-5, marks=pytest.mark.full),
])
def test_gradients_equal_one_process(model, extra, layout, world, tol):
    assert_layout_matches_single([f"model={model}", *STEP, *extra], layout, world, tol=tol)


@pytest.mark.parametrize(("layout", "extra", "what"), [
    ("fsdp_tp2", [], "tp=2"),
    ("fsdp2_pp2", [], "pp=2"),
    ("fsdp2", ["train.fused_head_loss=false"], "train.fused_head_loss=false"),
])
def test_refused_layouts_are_one_plan_error(layout, extra, what):
    from hyperpar.errors import PlanError
    from hyperpar.plan import make_plan

    cfg = compose_cfg([f"parallel={layout}", "parallel.fsdp_vocab_parallel=true", *extra])
    with pytest.raises(PlanError, match=f"not supported: parallel.fsdp_vocab_parallel with {what}"):
        make_plan(cfg)


def test_dry_run_says_the_vocabulary_is_sharded():
    from hyperpar.plan import make_plan

    on = make_plan(compose_cfg(["parallel=fsdp4", "parallel.fsdp_vocab_parallel=true"]))
    off = make_plan(compose_cfg(["parallel=fsdp4"]))
    assert "sharded by vocabulary over dp_shard x cp = 4" in on.render()
    assert on.root_unit_params < off.root_unit_params / 10  # the root's gather leaves out embedding and head


@pytest.mark.slow
def test_training_checkpoint_and_export(tmp_path):
    """10 steps under fsdp2 with the vocabulary sharded equal the single run within 1e-5; its step-5
    checkpoint continues on one process; the end-of-run HF export equals the offline export of its
    last checkpoint. (10 steps: at step 17 this tiny run's loss moves by 1.4e-5 under any layout that
    reorders the head's sums, tp2 as much as this one.)"""
    from safetensors.torch import load_file

    base = tmp_path / "single"
    assert cli_small(base, ["parallel=single"], steps=10).returncode == 0
    run = tmp_path / "vocab"
    res = cli_small(run, ["parallel=fsdp2", "parallel.fsdp_vocab_parallel=true", *CKPT,
                          "checkpoint.export_hf_at_end=true"], steps=10)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sharded by vocabulary over 2 FSDP ranks" in (run / "logs" / "rank_0.log").read_text()
    ref, got = read_losses(base), read_losses(run)
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    assert max(abs(got[s] - ref[s]) for s in ref) <= 1e-5
    resumed = tmp_path / "resumed"
    res = cli_small(resumed, ["parallel=single", *CKPT, f"checkpoint.load_path={run / 'checkpoints' / 'step_5'}"], steps=10)
    assert res.returncode == 0, res.stderr[-3000:]
    cont = read_losses(resumed)
    assert sorted(cont) == list(range(6, 11)) and max(abs(cont[s] - ref[s]) for s in cont) <= 1e-5
    offline = tmp_path / "offline"
    res = run_cli([str(run / "checkpoints" / "step_10"), str(offline)], cwd=tmp_path, module="hyperpar.export", timeout=300)
    assert res.returncode == 0, res.stderr
    live, off = load_file(run / "hf" / "model.safetensors"), load_file(offline / "model.safetensors")
    assert set(live) == set(off) and all(torch.equal(live[k], off[k]) for k in live)
