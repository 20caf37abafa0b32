"""Checkpoints of models with parameters that have not had a gradient yet, so AdamW holds no state
for them: the MTP head of ``qwen3_5_moe`` at ``model.mtp_loss_weight=0`` (the default), the vision
tower of a VL model on text-only batches. They save without optimizer state and resume exactly, and
a resumed run that does train them starts their state fresh (docs/guide/checkpointing.md).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import cli_small, records, run_small
from hyperpar.checkpoint import state as st

TEXT = ["model=qwen3_5_moe"]
# Sample 0-3 (step 1) are text-only, step 2 holds an image: the vision tower's first gradient is at step 2.
VL_TEXT_FIRST = ["model=qwen3_5_moe_vl", "data=vl_dummy", "data.extra.text_fraction=0.9", "data.extra.video_fraction=0"]


def _ckpt(overrides: list[str], every: int) -> list[str]:
    return [*overrides, "checkpoint=default", f"checkpoint.save_steps={every}", "checkpoint.keep_last=0"]


def _keys(step_dir: Path) -> dict:
    return st.read_metadata(step_dir).state_dict_metadata


def _has_state(keys: dict, prefix: str) -> bool:
    return any(k.startswith(f"optim.state.{prefix}") for k in keys)


def _saved_step(step_dir: Path, param: str) -> float:
    """The AdamW step count a checkpoint holds for ``param``."""
    key = f"optim.state.{param}.step"
    md = _keys(step_dir)[key]
    box = {"optim": {f"state.{param}.step": torch.zeros(tuple(md.size), dtype=md.properties.dtype)}}
    st.load_tensors(step_dir, box, no_dist=True)
    return float(box["optim"][f"state.{param}.step"])


def _stop_and_resume(tmp_path: Path, model: list[str], *, stop: int, every: int, steps: int = 4) -> Path:
    base, run = tmp_path / "base", tmp_path / "run"
    run_small(base, model, steps=steps)
    run_small(run, [*_ckpt(model, every), f"train.stop_after_steps={stop}"], steps=steps)
    run_small(run, _ckpt(model, every), steps=steps)
    assert records(run) == records(base)  # bitwise: loss, grad norm, LR, tokens per step
    return run


def test_untrained_mtp_head_resumes_bitwise(tmp_path):
    run = _stop_and_resume(tmp_path, TEXT, stop=2, every=2)
    keys = _keys(run / "checkpoints" / "step_2")
    assert "model.mtp.fc.weight" in keys and not _has_state(keys, "mtp.")  # saved: values, no state
    assert _has_state(keys, "model.embed_tokens.")
    assert not _has_state(_keys(run / "checkpoints" / "step_4"), "mtp.")  # the resumed run did not invent any


def test_vision_tower_first_trained_after_resume_is_bitwise(tmp_path):
    run = _stop_and_resume(tmp_path, VL_TEXT_FIRST, stop=1, every=1)
    assert not _has_state(_keys(run / "checkpoints" / "step_1"), "model.visual.")
    assert _has_state(_keys(run / "checkpoints" / "step_2"), "model.visual.")
    assert not _has_state(_keys(run / "checkpoints" / "step_4"), "mtp.")


def test_resume_that_trains_the_mtp_head_starts_its_state_fresh(tmp_path):
    run = tmp_path / "run"
    run_small(run, [*_ckpt(TEXT, 2), "train.stop_after_steps=2"], steps=4)
    losses = run_small(run, [*_ckpt(TEXT, 2), "model.mtp_loss_weight=0.5"], steps=4)
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    step4 = run / "checkpoints" / "step_4"
    assert _saved_step(step4, "mtp.fc.weight") == 2.0  # its first gradient was step 3
    assert _saved_step(step4, "model.embed_tokens.weight") == 4.0


def test_resume_that_stops_training_the_mtp_head_keeps_its_state(tmp_path):
    run = tmp_path / "run"
    run_small(run, [*_ckpt(TEXT, 2), "model.mtp_loss_weight=0.5", "train.stop_after_steps=2"], steps=4)
    run_small(run, _ckpt(TEXT, 2), steps=4)
    assert _saved_step(run / "checkpoints" / "step_4", "mtp.fc.weight") == 2.0  # kept, not advanced


def test_untrained_means_all_of_a_parameters_state_missing():
    t = torch.zeros(1)
    tensors = {"model": {"a.weight": t, "b.weight": t, "b.weight_scale": t},
               "optim": {"state.a.weight.step": t, "state.a.weight.exp_avg": t, "state.b.weight.step": t,
                         "state.b.weight_scale.step": t}}

    def untrained(*saved: str) -> list[str]:
        return st.untrained_params(SimpleNamespace(state_dict_metadata=dict.fromkeys(saved)), tensors)

    model = ("model.a.weight", "model.b.weight", "model.b.weight_scale")
    assert untrained(*model, "optim.state.a.weight.step", "optim.state.a.weight.exp_avg") == ["b.weight", "b.weight_scale"]
    assert untrained(*model, "optim.state.a.weight.step", "optim.state.b.weight_scale.step") == ["b.weight"]
    assert untrained(*model, "optim.state.a.weight.step", "optim.state.b.weight.step",
                     "optim.state.b.weight_scale.step") == []  # a's partial state is a mismatch, not "untrained"
    assert untrained(*model) == []  # no optimizer state at all: not a mid-training checkpoint
    assert untrained("model.a.weight", "optim.state.a.weight.step", "optim.state.a.weight.exp_avg") == []  # b: no value


@pytest.mark.full
@pytest.mark.parametrize("layout", ["fsdp2", "ddp2"])
def test_multiprocess_untrained_mtp_head_resumes_bitwise(tmp_path, layout):
    base, run = tmp_path / "base", tmp_path / "run"
    for where, extra in ((base, []), (run, [*_ckpt([], 2), "train.stop_after_steps=2"]), (run, _ckpt([], 2))):
        res = cli_small(where, [*TEXT, f"parallel={layout}", *extra], steps=4)
        assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    assert not _has_state(_keys(run / "checkpoints" / "step_2"), "mtp.")
    assert records(run) == records(base)
    # on another layout (DCP reshards the state there is; the missing state stays missing)
    other = run_small(tmp_path / "single", [*TEXT, f"checkpoint.load_path={run}/checkpoints/step_2"], steps=4)
    want = records(base)
    assert sorted(other) == [3, 4] and all(abs(other[s] - want[s]["loss"]) <= 1e-5 for s in other)
