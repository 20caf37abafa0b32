"""Checkpoints: exact resume (any DP layout), resume on another layout, atomic saves, bad input, HF export.

Runs are tiny (debug model, 16 tokens x 4 samples per step, one thread per rank). Multi-process runs go
through the real CLI and are marked slow; everything one process can prove runs in-process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fixtures
from fixtures import CKPT, SMALL
from helpers import cli_small, compose_cfg, one_error_line, read_losses, records, run_cli, run_small, steps_logged
from hyperpar.checkpoint import directory as d
from hyperpar.errors import CheckpointError
from hyperpar.launch import run_job, worker_main

@pytest.fixture(scope="module")
def single_base(tmp_path_factory) -> Path:
    """The uninterrupted single-process 20-step run, saving every 5 steps (kept: all)."""
    run = tmp_path_factory.mktemp("single") / "base"
    run_small(run, [*CKPT, "checkpoint.keep_last=0"])
    return run


# ---- exact resume ---------------------------------------------------------------------------------
def test_single_stop_and_resume_is_bitwise(single_base, tmp_path):
    run = tmp_path / "run"
    first = run_small(run, [*CKPT, "train.stop_after_steps=10"])
    assert sorted(first) == list(range(1, 11))
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [5, 10]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_10"
    run_small(run, CKPT)  # resume: auto
    assert steps_logged(run) == list(range(1, 21))  # metrics.jsonl continues, nothing re-run
    assert records(run) == records(single_base)  # bitwise: losses, grad norms, LRs, token counters
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [15, 20]  # keep_last=2
    state = json.loads((run / "checkpoints" / "step_20" / "train_state.json").read_text())
    assert state["counters"] == {"step": 20, "samples_seen": 80, "tokens_seen": 20 * 4 * 16}
    assert state["loader"]["step"] == 20


def test_async_save_resume_is_bitwise(single_base, tmp_path):
    run = tmp_path / "run"
    run_small(run, [*CKPT, "checkpoint.async_save=true", "train.stop_after_steps=10"])
    assert [s for s, _ in d.list_complete(run / "checkpoints")] == [5, 10]
    run_small(run, [*CKPT, "checkpoint.async_save=true"])
    assert records(run) == records(single_base)


def test_explicit_load_path_into_a_new_run(single_base, tmp_path):
    run = tmp_path / "new"
    run_small(run, [*CKPT, f"checkpoint.load_path={single_base}/checkpoints/step_10", "checkpoint.resume=never"])
    assert steps_logged(run) == list(range(11, 21))
    base = records(single_base)
    assert records(run) == {s: base[s] for s in range(11, 21)}


def test_resume_takes_the_schedule_shape_from_the_config_from_its_first_step(single_base, tmp_path):
    """A resume under another schedule (cosine -> constant) ran its first step at the saving run's next LR (the
    loaded param groups' value), the configured schedule only from its second step on; an optim.lr that differs
    from the checkpoint's was ignored without a word, and so was a change of the data stream (here the seed)."""
    constant = records(run_small(tmp_path / "constant", ["optim=adamw_constant", "train.stop_after_steps=8"]) and
                       tmp_path / "constant")
    run = tmp_path / "resumed"
    run_small(run, ["optim=adamw_constant", "optim.lr=0.5", "optim.beta1=0.5", f"checkpoint.load_path={single_base}/checkpoints/step_5",
                    "train.stop_after_steps=8", "train.seed=7"])
    got = records(run)
    assert [got[s]["lr"] for s in (6, 7, 8)] == [constant[s]["lr"] for s in (6, 7, 8)]
    assert records(single_base)[6]["lr"] != constant[6]["lr"]  # the two schedules differ there
    log = (run / "logs" / "rank_0.log").read_text()
    assert "not applied: optim.lr=0.5 (the checkpoint's 0.001), optim.beta1=0.5 (the checkpoint's 0.9)" in log
    assert "resumed with other data than the saving run" in log and "train.seed=7 (was " in log  # said, not refused


def test_a_warmup_longer_than_the_run_is_said(tmp_path):
    run_small(tmp_path / "short", ["optim.warmup_steps=5"], steps=2)
    assert "optim.warmup_steps=5 > train.steps=2: the run ends inside the warmup" in \
        (tmp_path / "short" / "logs" / "rank_0.log").read_text()
    run_small(tmp_path / "long", ["optim.warmup_steps=2"], steps=2)
    assert "inside the warmup" not in (tmp_path / "long" / "logs" / "rank_0.log").read_text()


def test_resume_across_a_change_of_embedding_tying_is_refused(tmp_path):
    """A tied checkpoint saves lm_head.weight as the embedding's value with no optimizer state of its own, so an
    untied model resumed from it passed every check and trained on with a fresh, untied head."""
    tied = tmp_path / "tied"
    run_small(tied, ["checkpoint=default", "checkpoint.save_steps=2", "+model.overrides.tie_word_embeddings=true"], steps=2)
    with pytest.raises(CheckpointError, match="ties its input and output embeddings .*this model unties them"):
        run_small(tmp_path / "untied", [f"checkpoint.load_path={tied}/checkpoints/step_2"], steps=3)
    # the same tying resumes; a checkpoint already at train.steps says there is nothing to train (it said nothing)
    run_small(tmp_path / "again", [f"checkpoint.load_path={tied}/checkpoints/step_2",
                                   "+model.overrides.tie_word_embeddings=true"], steps=2)
    assert "nothing to train: the resumed checkpoint is at step 2" in (tmp_path / "again" / "logs" / "rank_0.log").read_text()


def test_rewinding_in_the_own_run_dir_leaves_the_later_branch(tmp_path):
    """load_path = an earlier checkpoint of the run's own dir (a rewind): its newer checkpoints used to stay the
    newest, so the next resume=auto (and a crash restart) jumped back to the abandoned branch, and the stop
    message named it. They move to checkpoints/abandoned/, later metrics to metrics.abandoned.jsonl."""
    run, save = tmp_path / "run", ["checkpoint=default", "checkpoint.save_steps=2", "checkpoint.keep_last=0"]
    run_small(run, save, steps=6)
    first = records(run)
    run_small(run, [*save, f"checkpoint.load_path={run}/checkpoints/step_2", "train.stop_after_steps=3"], steps=6)
    root = run / "checkpoints"
    assert [s for s, _ in d.list_complete(root)] == [2, 3]
    assert sorted(p.name for p in (root / d.ABANDONED).glob("*/step_*")) == ["step_4", "step_6"]
    assert (root / "latest").read_text().strip() == "step_3"
    assert steps_logged(run) == [1, 2, 3]
    assert len((run / "metrics.abandoned.jsonl").read_text().splitlines()) == 4  # steps 3-6 of the first branch
    run_small(run, save, steps=6)  # resume=auto continues the new branch from step_3
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6] and records(run) == first
    assert d.resolve_load_path(root / "latest") == root / "step_6"  # checkpoints/latest as a load_path


def test_resume_with_a_smaller_global_batch_runs_to_the_end(tmp_path):
    # 16 samples consumed at global batch 4, then 4 more steps at 2: samples 16..23, past the
    # 8 x 2 = 16 the data source was sized for before the fix (IndexError at the first step).
    data = ["data=json", "train.steps=8"]
    run_small(tmp_path / "a", [*CKPT, *data, "train.stop_after_steps=4"], steps=8)
    run = tmp_path / "b"
    run_small(run, [*CKPT, *data, f"checkpoint.load_path={tmp_path}/a/checkpoints/step_4",
                    "train.global_batch_size=2"], steps=8)
    recs = records(run)
    assert sorted(recs) == [5, 6, 7, 8] and {r["tokens"] for r in recs.values()} == {2 * 16}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param("ddp2", marks=pytest.mark.full), "fsdp2",
                                    pytest.param("hsdp2x2", marks=pytest.mark.full)])
def test_multiprocess_stop_and_resume_is_bitwise(tmp_path, layout):
    base, run = tmp_path / "base", tmp_path / "run"
    res = cli_small(base, [f"parallel={layout}"])
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli_small(run, [f"parallel={layout}", *CKPT, "train.stop_after_steps=10"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert steps_logged(run) == list(range(1, 11))
    res = cli_small(run, [f"parallel={layout}", *CKPT])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr and "step_10" in res.stderr
    assert steps_logged(run) == list(range(1, 21))
    assert records(run) == records(base)  # steps 11-20 (and 1-10) bitwise equal


@pytest.mark.full  # CI keeps cross-layout resume: cp2 <-> fsdp2, ep2 <-> single, fsdp2_tp2_pp2 -> single
def test_fsdp4_checkpoint_resumes_on_fsdp2_and_single(tmp_path):
    """DCP reshards: a 4-way sharded checkpoint continues on 2 ranks and on 1 within 1e-5 of the uninterrupted run.
    The fsdp4 run also exports HF at the end from its DTensors (gathered on rank 0)."""
    base = tmp_path / "fsdp4"
    res = cli_small(base, ["parallel=fsdp4", *CKPT, "checkpoint.keep_last=0", "checkpoint.export_hf_at_end=true"])
    assert res.returncode == 0, res.stderr[-3000:]
    ref = read_losses(base)
    step10 = base / "checkpoints" / "step_10"
    assert sorted(p.name for p in step10.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    worst = {}
    for layout in ("fsdp2", "single"):
        run = tmp_path / layout
        res = cli_small(run, [f"parallel={layout}", *CKPT, f"checkpoint.load_path={step10}"])
        assert res.returncode == 0, res.stderr[-3000:]
        losses = read_losses(run)
        assert sorted(losses) == list(range(11, 21))
        worst[layout] = max(abs(losses[s] - ref[s]) for s in losses)
    print("max |loss - uninterrupted fsdp4| over steps 11-20:", worst)
    assert all(w <= 1e-5 for w in worst.values()), worst
    # The end-of-run export (live DTensors, gathered) equals the offline export of the final checkpoint.
    out = tmp_path / "offline"
    res = run_cli([str(base / "checkpoints" / "step_20"), str(out)], cwd=tmp_path, module="hyperpar.export", timeout=300)
    assert res.returncode == 0, res.stderr
    _assert_same_hf(base / "hf", out)


# ---- atomic saves ------------------------------------------------------------------------------------
def test_save_killed_halfway_resumes_from_previous_complete(single_base, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    res = cli_small(run, CKPT, env={"HYPERPAR_TEST_KILL_IN_SAVE": "10"})
    assert res.returncode == -9, res.stderr[-2000:]  # SIGKILL inside the save of step 10
    ckpts = run / "checkpoints"
    assert (ckpts / "step_10.tmp" / ".metadata").is_file()  # the data was written ...
    assert not (ckpts / "step_10.tmp" / d.MARKER).exists()  # ... but never published
    assert [s for s, _ in d.list_complete(ckpts)] == [5]
    assert (ckpts / "latest").read_text().strip() == "step_5"
    assert steps_logged(run) == list(range(1, 11))
    run_small(run, CKPT)  # resume: auto takes step_5, not the half-saved step_10
    assert steps_logged(run) == list(range(1, 21))  # the crashed attempt's steps 6-10 moved aside
    assert [json.loads(x)["step"] for x in (run / "metrics.abandoned.jsonl").read_text().splitlines()] == list(range(6, 11))
    assert records(run) == records(single_base)
    assert [s for s, _ in d.list_complete(ckpts)] == [15, 20]


def test_directory_rules(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / d.MARKER).write_text("{}")
    (root / "step_9.tmp").mkdir()  # interrupted save
    (root / "step_7").mkdir()  # no marker
    (root / "step_7" / ".metadata").write_text("")
    assert d.newest_complete(root) == root / "step_4"
    assert d.prune(root, 2) == [root / "step_1", root / "step_2"]
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_7", "step_9.tmp"]
    assert d.resolve_load_path(tmp_path) == root / "step_4"  # a run dir: its newest complete checkpoint
    with pytest.raises(CheckpointError, match="step_7' is incomplete"):
        d.resolve_load_path(root / "step_7")
    with pytest.raises(CheckpointError, match="step_9.tmp' is incomplete"):
        d.resolve_load_path(root / "step_9.tmp")
    assert d.prune(root, 0) == []  # keep_last=0 keeps all


# ---- bad input: one line, non-zero exit, before any worker starts ------------------------------------
def test_missing_load_path_is_one_line(tmp_path):
    res = cli_small(tmp_path / "run", [*CKPT, f"checkpoint.load_path={tmp_path}/nope"])
    line = one_error_line(res)
    assert line.startswith("checkpoint error: checkpoint.load_path") and "does not exist" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(CheckpointError, match="does not exist"):  # the worker's own check (torchrun path)
        worker_main(compose_cfg([*SMALL, *CKPT, f"checkpoint.load_path={tmp_path}/nope"]), str(tmp_path / "w"))


def test_checkpoint_of_another_geometry_is_one_line(single_base, tmp_path):
    hf = tmp_path / "tiny"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(fixtures.qwen3_5()))
    step10 = single_base / "checkpoints" / "step_10"
    other = [f"model.hf_path={hf}", "model.load_weights=false", *CKPT, f"checkpoint.load_path={step10}"]
    line = one_error_line(cli_small(tmp_path / "run", other))
    assert "does not match the model" in line, line
    assert "model.model.embed_tokens.weight (2048, 128) in checkpoint != (1024, 64) expected" in line, line
    assert "saved for qwen3_5 (flavor=debug)" in line, line
    with pytest.raises(CheckpointError, match=r"wrong shape \d+: model\.model\.embed_tokens\.weight \(2048, 128\)"):
        worker_main(compose_cfg([*SMALL, *other]), str(tmp_path / "w"))


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "train_state.json"])
def test_truncated_checkpoint_is_one_line(single_base, tmp_path, victim):
    ckpt = tmp_path / "ckpt" / "step_10"
    shutil.copytree(single_base / "checkpoints" / "step_10", ckpt)
    f = ckpt / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = one_error_line(cli_small(tmp_path / "run", [*CKPT, f"checkpoint.load_path={ckpt}"]))
    assert line.startswith("checkpoint error:") and "truncated" in line and victim in line, line
    if victim == "__0_0.distcp":  # the worker refuses it too, before dcp.load touches it
        with pytest.raises(CheckpointError, match="is truncated"):
            worker_main(compose_cfg([*SMALL, *CKPT, f"checkpoint.load_path={ckpt}"]), str(tmp_path / "w"))


def test_worker_errors_keep_their_kind_in_the_driver():
    from hyperpar.errors import ConfigError, TrainingError
    from hyperpar.launch import _user_error

    e = _user_error("checkpoint error: checkpoint file 'x' is truncated: 1 bytes (hint: use an earlier checkpoint)\n")
    assert type(e) is CheckpointError and e.one_line() == "checkpoint error: checkpoint file 'x' is truncated: 1 bytes (hint: use an earlier checkpoint)"
    assert type(_user_error("config error: bad key")) is ConfigError
    assert type(_user_error("something odd")) is TrainingError


# ---- Hugging Face export --------------------------------------------------------------------------------
def _assert_same_hf(a: Path, b: Path) -> None:
    from hyperpar.models import HFCheckpoint

    with HFCheckpoint(a) as x, HFCheckpoint(b) as y:
        assert x.config == y.config
        assert sorted(x.keys()) == sorted(y.keys())
        for k in x.keys():
            assert torch.equal(x.read(k), y.read(k)), k


def _transformers_matches(ours: torch.nn.Module, hf_dir: Path, vocab: int) -> float:
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_sd = hf.state_dict()
    from hyperpar.models.hf_io import hf_state_dict

    for name, t in hf_state_dict(ours).items():
        assert torch.equal(hf_sd[name], t), name  # the export is lossless
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ours.eval()(ids)
        return (hf(input_ids=ids, use_cache=False).logits - getattr(out, "logits", out)).abs().max().item()


def test_export_cli_reloads_in_transformers(single_base, tmp_path):
    pytest.importorskip("transformers")
    from hyperpar.checkpoint.hf_export import load_checkpoint_model

    out = tmp_path / "hf"
    res = run_cli([str(single_base), str(out), "--max-shard-size", "1MB"], cwd=tmp_path, module="hyperpar.export",
                  timeout=300)  # a run dir: its newest complete checkpoint (step_20)
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f for f in files if f.startswith("model-")} and len(index["weight_map"]) > 2
    ours = load_checkpoint_model(single_base / "checkpoints" / "step_20")
    diff = _transformers_matches(ours, out, vocab=2048)
    print("export: max |logits transformers - ours| =", diff)
    assert diff <= 1e-6


def test_export_at_end_tied_geometry(tmp_path):
    """export_hf_at_end for another geometry (tied embeddings, from an HF config.json) reloads in transformers."""
    pytest.importorskip("transformers")
    from hyperpar.checkpoint.hf_export import load_checkpoint_model

    hf = tmp_path / "tiny"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(fixtures.qwen3_5()))
    run = tmp_path / "run"
    cfg = compose_cfg(["metrics.progress_bar=false", *SMALL, "train.steps=2", f"model.hf_path={hf}", "model.load_weights=false",
                       "checkpoint=default", "checkpoint.export_hf_at_end=true"])
    run_job(cfg, str(run))
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((run / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    ours = load_checkpoint_model(run / "checkpoints" / "step_2")  # next to the checkpoint: its config.yaml
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert _transformers_matches(ours, run / "hf", vocab=1024) <= 1e-6


def test_export_bad_input_is_one_line(single_base, tmp_path):
    line = one_error_line(run_cli([str(tmp_path / "nope"), str(tmp_path / "out")], cwd=tmp_path, module="hyperpar.export"))
    assert line == f"checkpoint error: checkpoint '{tmp_path}/nope' does not exist (hint: give a checkpoints/step_<n> " \
                   "directory or a run directory that has checkpoints)"
    lonely = tmp_path / "lonely" / "step_5"
    shutil.copytree(single_base / "checkpoints" / "step_5", lonely)
    (lonely / "config.yaml").unlink()
    line = one_error_line(run_cli([str(lonely), str(tmp_path / "out")], cwd=tmp_path, module="hyperpar.export"))
    assert "no config.yaml next to" in line and "--config" in line, line
    assert not (tmp_path / "out").exists()
