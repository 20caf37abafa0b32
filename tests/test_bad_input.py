"""Every bad value is one line, exit 2: the key or file named, no traceback, at most 3 output lines.

One table for the three entry points (``python -m hyperpar``, ``hyperpar.export``,
``hyperpar.data.megatron.convert``), run in this process (``helpers.run_entry``) so 50 cases take
seconds, not minutes. ``{t}`` in a case is the test's scratch dir, ``{ck}`` a saved checkpoint.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from fixtures import SMALL
from helpers import run_entry, run_small

TOKENIZER = str(Path(__import__("hyperpar.data.hf", fromlist=["resolve_path"]).resolve_path("pkg://hyperpar.data/corpus/tokenizer")))
RUN = ["train.steps=2", "metrics.progress_bar=false"]

# (entry point, arguments, text the one error line must hold)
CASES: list[tuple[str, list[str], str]] = [
    # values no run can use: named by key, refused before anything is built
    ("hyperpar", ["train.global_batch_size=0"], "train.global_batch_size=0 must be >= 1"),
    ("hyperpar", ["train.global_batch_size=-8"], "train.global_batch_size=-8 must be >= 1"),
    ("hyperpar", ["train.micro_batch_size=0"], "train.micro_batch_size=0 must be >= 1"),
    ("hyperpar", ["train.micro_batch_size=-2"], "train.micro_batch_size=-2 must be >= 1"),
    ("hyperpar", ["train.seq_len=-5"], "train.seq_len=-5 must be >= 1"),
    ("hyperpar", ["train.seq_len=0"], "train.seq_len=0 must be >= 1"),
    ("hyperpar", ["train.steps=0"], "train.steps=0 must be >= 1"),
    ("hyperpar", ["train.seed=-1"], "train.seed=-1 must be in [0, 2**32)"),
    ("hyperpar", ["train.log_every=0"], "train.log_every=0 must be >= 1"),
    ("hyperpar", ["train.max_grad_norm=inf"], "train.max_grad_norm=inf must be a finite number"),
    ("hyperpar", ["train.mixed_precision.param_dtype=float8"], "train.mixed_precision.param_dtype=float8 must be one of"),
    ("hyperpar", ["train.activation_checkpoint=partial"], "train.activation_checkpoint=partial must be one of"),
    ("hyperpar", ["optim.lr=-1e-3"], "optim.lr=-0.001 must be a finite number >= 0"),
    ("hyperpar", ["optim.lr=nan"], "optim.lr=nan must be a finite number >= 0"),
    ("hyperpar", ["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be >= 0"),
    ("hyperpar", ["optim.beta1=1.5"], "optim.beta1=1.5 must be in [0, 1)"),
    ("hyperpar", ["optim.eps=0"], "optim.eps=0.0 must be a finite number > 0"),
    ("hyperpar", ["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be"),
    ("hyperpar", ["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    ("hyperpar", ["optim.schedule=cosin"], "optim.schedule=cosin must be one of cosine, constant, linear"),
    ("hyperpar", ["checkpoint.save_steps=-1"], "checkpoint.save_steps=-1 must be >= 0"),
    ("hyperpar", ["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be >= 0"),
    ("hyperpar", ["checkpoint.resume=sometimes"], "checkpoint.resume=sometimes must be one of auto, never"),
    ("hyperpar", ["launch.max_restarts=-1"], "launch.max_restarts=-1 must be >= 0"),
    ("hyperpar", ["model.mtp_loss_weight=-1"], "model.mtp_loss_weight=-1.0 must be"),
    # data: the file (and line) named
    ("hyperpar", ["data=json", "data.path={t}/nonutf8.jsonl"], "{t}/nonutf8.jsonl:2: not UTF-8 text (byte 0xff"),
    ("hyperpar", ["data=json", "data.path={t}/empty.jsonl"], "{t}/empty.jsonl: the file holds no records"),
    ("hyperpar", ["data=json", "data.path={t}/badline.jsonl"], "{t}/badline.jsonl:3: not valid JSON (Expecting value"),
    ("hyperpar", ["data=json", "data.path={t}/none.jsonl"], "{t}/none.jsonl"),
    ("hyperpar", ["data=preset", "data.path={t}/text.pt"], "{t}/text.pt: cannot read it: not a torch.save file of tensors"),
    ("hyperpar", ["data=preset", "data.path={t}/text.safetensors"], "{t}/text.safetensors: cannot read it: not a safetensors file"),
    ("hyperpar", ["data=preset", "data.path={t}/list.pt"], "{t}/list.pt: expected a dict of tensors"),
    ("hyperpar", ["data=megatron", "data.blend='0.3 0.7'"], "'0.7' stands where a corpus prefix is expected"),
    ("hyperpar", ["data=megatron", "data.blend='0.3 0.5 {t}/a'"], "'0.3' stands where a corpus prefix is expected"),
    ("hyperpar", ["data=megatron", "data.prefix={t}/nocorpus"], "{t}/nocorpus.idx"),
    # model directories
    ("hyperpar", ["model.hf_path={t}/hf_badtype"], "{t}/hf_badtype/config.json: field 'hidden_size' is 'big'"),
    ("hyperpar", ["model.hf_path={t}/hf_badjson"], "{t}/hf_badjson/config.json: invalid JSON"),
    ("hyperpar", ["model.hf_path={t}/no_such_model"], "model.hf_path '{t}/no_such_model' does not exist"),
    # run dirs
    ("hyperpar", ["hydra.run.dir={t}/a_file/run"], "cannot create the run dir '{t}/a_file/run'"),
    ("hyperpar", ["hydra.run.dir=/proc/hyperpar_run"], "run dir '/proc/hyperpar_run'"),
    # checkpoints
    ("hyperpar", ["checkpoint.load_path={t}/nope"], "checkpoint.load_path '{t}/nope' does not exist"),
    ("hyperpar", ["checkpoint.load_path={ck}/corrupt/step_4"], "{ck}/corrupt/step_4/__0_0.distcp' is corrupt"),
    ("hyperpar", ["checkpoint.load_path={ck}/pickle/step_4"], "asks to load"),
    ("hyperpar", ["checkpoint.load_path={ck}/base/checkpoints/step_4", "train.global_batch_size=3"],
     "with train.global_batch_size=3"),
    ("hyperpar", ["checkpoint.load_path={ck}/truncated/step_4"], "{ck}/truncated/step_4/__0_0.distcp' is truncated"),
    # export
    ("hyperpar.export", ["{ck}/base/checkpoints/step_4", "{t}/a_file"], "export target '{t}/a_file' is an existing file"),
    ("hyperpar.export", ["{ck}/corrupt/step_4", "{t}/hf_out"], "{ck}/corrupt/step_4/__0_0.distcp' is corrupt"),
    ("hyperpar.export", ["{t}/nothing_here", "{t}/hf_out"], "checkpoint '{t}/nothing_here' does not exist"),
    ("hyperpar.export", ["{ck}/base/checkpoints/step_4", "{t}/hf_out", "--dtype", "float8"], "unknown dtype 'float8'"),
    ("hyperpar.export", ["{ck}/pickle/step_4", "{t}/hf_out"], "refused before running it"),
    # converter
    ("hyperpar.data.megatron.convert", ["--input", "{t}/nonutf8.jsonl", "--tokenizer", TOKENIZER, "--output-prefix", "{t}/c/x",
                                        "--quiet"], "{t}/nonutf8.jsonl:2: not UTF-8 text"),
    ("hyperpar.data.megatron.convert", ["--input", "{t}/badline.jsonl", "--tokenizer", TOKENIZER, "--output-prefix", "{t}/c/x",
                                        "--quiet"], "{t}/badline.jsonl:3: not valid JSON"),
    ("hyperpar.data.megatron.convert", ["--input", "{t}/none.jsonl", "--tokenizer", TOKENIZER, "--output-prefix", "{t}/c/x",
                                        "--quiet"], "{t}/none.jsonl: input file not found"),
]


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """A saved 4-step run, and damaged copies of its step_4 (corrupt, truncated, pickle payload)."""
    from hyperpar.checkpoint import integrity

    root = tmp_path_factory.mktemp("bad_ckpt")
    run_small(root / "base", ["checkpoint=default", "checkpoint.save_steps=4"], steps=4)
    step = root / "base" / "checkpoints" / "step_4"
    for name in ("corrupt", "truncated", "pickle"):
        shutil.copytree(step, root / name / "step_4")
    data = root / "corrupt" / "step_4" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.seek(65536)
        f.write(b"\xff" * 4096)
    short = root / "truncated" / "step_4" / "__0_0.distcp"
    short.write_bytes(short.read_bytes()[:1000])
    evil = root / "pickle" / "step_4"
    (evil / ".metadata").write_bytes(pickle.dumps(_Payload()))
    marker = json.loads((evil / "COMPLETE").read_text())
    marker["files"].update(integrity.checksum_files(evil, [".metadata"]))
    (evil / "COMPLETE").write_text(json.dumps(marker))
    return root


def _inputs(t: Path) -> None:
    t.mkdir(parents=True, exist_ok=True)
    (t / "nonutf8.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe bad"}\n')
    (t / "empty.jsonl").write_bytes(b"")
    (t / "badline.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    (t / "text.pt").write_text("hello world, not tensors")
    (t / "text.safetensors").write_text("hello world, not tensors")
    torch.save([1, 2, 3], t / "list.pt")
    (t / "a_file").write_text("a regular file\n")
    for name, text in (("hf_badtype", '{"model_type": "qwen3_5_text", "hidden_size": "big"}'), ("hf_badjson", "{oops")):
        (t / name).mkdir()
        (t / name / "config.json").write_text(text)


@pytest.mark.parametrize("entry,args,expected", CASES, ids=[f"{e.split('.')[-1]}:{' '.join(a)[:60]}" for e, a, _ in CASES])
def test_bad_input_is_one_line_exit_2(entry, args, expected, ck, tmp_path, capfd):
    t = tmp_path / "in"
    _inputs(t)
    args = [a.format(t=t, ck=ck) for a in args]
    expected = expected.format(t=t, ck=ck)
    if entry == "hyperpar":
        if not any(a.startswith("hydra.run.dir=") for a in args):
            args.append(f"hydra.run.dir={tmp_path}/run")
        args = [*SMALL, *RUN, *args]
    code, lines = run_entry(entry, args, capfd)
    text = "\n".join(lines)
    assert "Traceback" not in text, text[-3000:]
    assert code == 2, text[-3000:]
    assert len(lines) <= 3, text
    errors = [ln for ln in lines if " error: " in ln]
    assert len(errors) == 1 and expected in errors[0], text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_table_is_large_enough():
    assert len(CASES) >= 40
