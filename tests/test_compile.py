"""train.compile: fsdp2 with compiled decoder blocks (and full activation checkpointing) trains like
the eager single process, loss and aux loss per step within 1e-5; layouts it is not built for are
refused by the plan."""

from __future__ import annotations

import re

import pytest

from helpers import cli_metrics, cli_small, one_error_line


@pytest.mark.slow
def test_compiled_fsdp2_with_ac_matches_eager_single(tmp_path):
    base = ["model=qwen3_5_moe", "model.mtp_loss_weight=0.3", "train.seq_len=64"]
    eager = cli_metrics(tmp_path / "eager", [*base, "parallel=single"], steps=4)
    compiled = cli_metrics(tmp_path / "compiled", [*base, "parallel=fsdp2", "train.compile=true",
                                                   "train.activation_checkpoint=full"], steps=4)
    log = (tmp_path / "compiled" / "logs" / "rank_0.log").read_text()
    assert re.search(r"train\.compile: [1-9]\d* decoder blocks compiled", log), log[-2000:]
    for s in eager:
        for key in ("loss", "aux_loss", "mtp_loss"):
            assert abs(eager[s][key] - compiled[s][key]) <= 1e-5, (s, key, eager[s][key], compiled[s][key])
    assert eager[1]["loss"] != eager[4]["loss"]


@pytest.mark.parametrize(("extra", "message"), [
    (["parallel=tp2"], "train.compile with tp not supported yet"),
    (["train.activation_checkpoint=selective"], "train.compile with activation_checkpoint=selective not supported"),
])
def test_compile_refused_where_not_built(tmp_path, extra, message):
    res = cli_small(tmp_path / "run", ["train.compile=true", *extra])
    assert res.returncode == 2 and message in one_error_line(res), res.stderr[-2000:]
