"""data=hf / data=json: loading, packing, padding, chat masking, exact sample counts, the token cache."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from hyperpar.data.hf import IGNORE_INDEX, resolve_path
from hyperpar.data.registry import DataContext, build_dataset
from hyperpar.errors import DataError

TOKENIZER = "pkg://hyperpar.data/corpus/tokenizer"
CORPUS = "pkg://hyperpar.data/corpus/shakespeare.jsonl"
DOCS = ["Shall I compare thee to a summer's day?", "", "Thou art more lovely and more temperate:", "   ",
        "Rough winds do shake the darling buds of May,", "And summer's lease hath all too short a date."]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_path(TOKENIZER))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(type_: str, *, seq_len: int, num_samples: int, seed: int = 7, run_dir=None, vocab: int = 2048, **options):
    ctx = DataContext(seq_len=seq_len, seed=seed, num_samples=num_samples, vocab_size=vocab,
                      run_dir=str(run_dir) if run_dir else None)
    options.setdefault("tokenizer", TOKENIZER)
    return build_dataset(type_, context=ctx, **options)


def expected_stream(tok, docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        if d.strip():
            out += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_packaged_corpus_and_tokenizer(tok):
    corpus = Path(resolve_path(CORPUS))
    assert corpus.is_file() and corpus.stat().st_size < 1_000_000
    first = json.loads(corpus.read_text().splitlines()[0])["text"]
    assert first.startswith("Sonnet I\n\nFrom fairest creatures we desire increase")
    assert len(tok) <= 2048 and tok.eos_token_id is not None and tok.chat_template


def test_packing_reconstructs_corpus_order_and_cycles(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    stream = expected_stream(tok, DOCS)
    seq = 8
    units = len(stream) // (seq + 1)
    n = 2 * units + 3
    src = build("json", path=path, seq_len=seq, num_samples=n, shuffle=False, pack=True)
    assert len(src) == n and src.units == units
    with pytest.raises(IndexError):
        src[n]
    rebuilt: list[int] = []
    for i in range(units):
        s = src[i]
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].shape == (seq,) == s["labels"].shape
        assert torch.equal(s["labels"][:-1], s["input_ids"][1:])  # pre-shifted
        assert (s["labels"] != IGNORE_INDEX).all()  # text: every position has a target
        rebuilt += s["input_ids"].tolist() + s["labels"][-1:].tolist()
    assert rebuilt == stream[: units * (seq + 1)]
    for j in range(units + 3):  # epoch 2 and 3 repeat epoch 1 exactly without shuffle
        assert torch.equal(src[units + j]["input_ids"], src[j % units]["input_ids"])


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS * 4])
    src = build("json", path=path, seq_len=4, num_samples=10_000, shuffle=True)
    u = src.units
    epochs = [[src.unit(e * u + j) for j in range(u)] for e in range(3)]
    assert all(sorted(e) == list(range(u)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = build("json", path=path, seq_len=4, num_samples=10_000, shuffle=True)
    other = build("json", path=path, seq_len=4, num_samples=10_000, shuffle=True, seed=8)
    assert [again.unit(i) for i in range(3 * u)] == sum(epochs, [])
    assert [other.unit(i) for i in range(u)] != epochs[0]
    i = 2 * u + 5
    assert torch.equal(src[i]["input_ids"], again[i]["input_ids"])  # a pure function of the index


def test_padding_one_document_per_sample(tmp_path, tok):
    docs = DOCS + ["word " * 40]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    seq = 12
    kept = [d for d in docs if d.strip()]
    src = build("json", path=path, seq_len=seq, num_samples=len(kept) + 2, shuffle=False, pack=False)
    assert src.units == len(kept)
    for i, d in enumerate(kept + kept[:2]):
        ids = (tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[: seq + 1]
        s = src[i]
        n = len(ids)
        assert s["input_ids"][: n - 1].tolist() == ids[:-1] if n <= seq else s["input_ids"].tolist() == ids[:seq]
        assert s["labels"][: n - 1].tolist() == ids[1:]
        assert (s["labels"][n - 1 :] == IGNORE_INDEX).all()  # padding (and nothing for a full row)
        assert (s["input_ids"][n - 1 :] == tok.pad_token_id).all()
        # the padding is masked (it was routed into the MoE load-balancing statistics like a real token)
        assert s["attention_mask"].tolist() == [1] * min(n, seq) + [0] * (seq - min(n, seq))


CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who wrote Macbeth?"},
                  {"role": "assistant", "content": "Shakespeare."}, {"role": "user", "content": "When?"},
                  {"role": "assistant", "content": "About 1606."}]},
    {"messages": [{"role": "user", "content": "No answer here."}]},  # no assistant turn: dropped
    {"messages": [{"role": "user", "content": "Name a witch."}, {"role": "assistant", "content": "Hecate."}]},
]


@pytest.mark.parametrize("pack", [False, True])
def test_chat_masks_everything_but_assistant_turns(tmp_path, tok, pack):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    src = build("json", path=path, seq_len=64, num_samples=4, shuffle=False, pack=pack)
    if pack:  # one block holding both conversations
        src = build("json", path=path, seq_len=src.docs.num_tokens - 1, num_samples=4, shuffle=False, pack=pack)
    assert src.docs.meta["chat"] is True and src.docs.meta["dropped"] == 1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    trained_text = []
    for i in range(src.units):
        s = src[i]
        targets = s["labels"][s["labels"] != IGNORE_INDEX].tolist()
        trained_text.append(tok.decode(targets))
        # every trained target is a token of an assistant turn; the role header, the user and system turns never are
        assert all(t != tok.convert_tokens_to_ids("<|im_start|>") for t in targets)
    joined = "".join(trained_text)
    # An assistant turn trains on what it adds after the generation prompt: content, end of turn, separator.
    assert joined == "Shakespeare.<|im_end|>\nAbout 1606.<|im_end|>\nHecate.<|im_end|>\n"
    assert "Who wrote" not in joined and "terse" not in joined and "assistant" not in joined
    assert im_end in src.docs.tokens


def test_hf_save_to_disk_parquet_and_json_agree(tmp_path):
    import datasets

    rows = {"text": DOCS, "id": list(range(len(DOCS)))}
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    jsonl = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    srcs = [build("hf", path=str(tmp_path / "saved"), seq_len=8, num_samples=6, shuffle=False),
            build("hf", path=str(tmp_path / "d.parquet"), seq_len=8, num_samples=6, shuffle=False),
            build("json", path=jsonl, seq_len=8, num_samples=6, shuffle=False)]
    for i in range(6):
        assert torch.equal(srcs[0][i]["input_ids"], srcs[1][i]["input_ids"])
        assert torch.equal(srcs[0][i]["input_ids"], srcs[2][i]["input_ids"])
    dd = datasets.DatasetDict({"train": ds, "validation": ds.select(range(2))})
    dd.save_to_disk(str(tmp_path / "dd"))
    val = build("hf", path=str(tmp_path / "dd"), split="validation", seq_len=8, num_samples=1, pack=False)
    assert val.units == 1  # the validation split: one non-empty document
    with pytest.raises(DataError, match="no split 'test'"):
        build("hf", path=str(tmp_path / "dd"), split="test", seq_len=8, num_samples=1)
    capped = build("hf", path=str(tmp_path / "saved"), max_samples=3, seq_len=8, num_samples=2, pack=False)
    assert capped.units == 2  # of the first three records one is empty
    # a plain (split-less) Dataset: another split, or a slice, would silently read every row
    for split in ("validation", "train[:2]"):
        with pytest.raises(DataError, match="save_to_disk Dataset without splits"):
            build("hf", path=str(tmp_path / "saved"), split=split, seq_len=8, num_samples=1)


def test_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    import hyperpar.data.hf as hf

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    first = build("json", path=path, seq_len=8, num_samples=5, run_dir=tmp_path / "run")
    entries = list((tmp_path / "run" / "data_cache").glob("tokens-*"))
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert not list((tmp_path / "run" / "data_cache").glob(".hf_datasets-*"))  # Arrow copy removed

    def no_build(*a, **k):
        raise AssertionError("rebuilt despite the cache")

    monkeypatch.setattr(hf, "_build", no_build)
    again = build("json", path=path, seq_len=8, num_samples=5, run_dir=tmp_path / "run")
    assert all(torch.equal(first[i]["input_ids"], again[i]["input_ids"]) for i in range(5))
    # Another option (text_key, tokenizer, data file) is another fingerprint: it must rebuild.
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    with pytest.raises(AssertionError, match="rebuilt"):
        build("json", path=path, seq_len=2, num_samples=1, run_dir=tmp_path / "run")


def _rank_worker(path: str, cache: str, q) -> None:
    src = build("json", path=path, seq_len=8, num_samples=20, cache_dir=cache)
    q.put([src[i]["input_ids"].tolist() for i in range(20)])


def test_concurrent_ranks_build_one_cache(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS * 3])
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_worker, args=(path, str(tmp_path / "cache"), q)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] == results[2]
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tokens-") and p.is_dir()]


def test_user_errors(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}])
    with pytest.raises(DataError, match="no column 'text' \\(columns: body\\)"):
        build("json", path=path, seq_len=8, num_samples=1)
    with pytest.raises(DataError, match="tokenizer directory '/nope' does not exist"):
        build("json", path=path, tokenizer="/nope", seq_len=8, num_samples=1)
    with pytest.raises(DataError, match="does not exist"):
        build("hf", path=str(tmp_path / "missing.jsonl"), seq_len=8, num_samples=1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="not a local path"):
        build("hf", path="someone/some_dataset", seq_len=8, num_samples=1)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"text": "Double, double toil and trouble"}])
    with pytest.raises(DataError, match="model's vocabulary has 100 ids"):
        build("json", path=ok, seq_len=4, num_samples=1, vocab=100)
    with pytest.raises(DataError, match="fewer than one packed sample"):
        build("json", path=ok, seq_len=512, num_samples=1)
    with pytest.raises(DataError, match="data.path is not set"):
        build("hf", seq_len=8, num_samples=1)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_throughput_counts_every_position_and_tokens_the_labelled_ones(tmp_path):
    """One padded document per row (pack=false): `tokens` is the labelled tokens (the loss's denominator), while
    tokens_per_s and mfu count every position the model ran over; they counted the labelled ones, so a masked or
    padded batch read as up to 5x slower at the same step time."""
    from helpers import metrics_by_step, run_small

    path = write_jsonl(tmp_path / "short.jsonl", [{"text": "to be or not " * (i + 1)} for i in range(8)])
    run = tmp_path / "run"
    run_small(run, ["data=json", f"data.path={path}", "data.pack=false", "train.seq_len=64"], steps=1)
    rec = metrics_by_step(run)[1]
    assert rec["tokens"] < 4 * 64 / 2  # short documents: most of every row is padding
    assert rec["tokens_per_s"] * rec["step_time_s"] == pytest.approx(4 * 64)
    assert isinstance(rec["page_faults"], int) and rec["page_faults"] >= 0  # CPU: the step's own count


def test_a_global_batch_without_labels_is_skipped_not_fatal(tmp_path):
    """A chat sample whose prompt fills train.seq_len has no labelled token: with one sample per step
    that step is skipped (no update; the LR schedule and the data move on) instead of stopping the
    run; a run of such batches is a masking error and stops it."""
    from helpers import metrics_by_step, run_small

    from hyperpar.errors import TrainingError

    long = {"messages": [{"role": "user", "content": "Tell me " * 30}, {"role": "assistant", "content": "No."}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [long, CHATS[2], CHATS[2]])
    data = ["data=json", f"data.path={path}", "data.pack=false", "data.shuffle=false", "train.global_batch_size=1",
            "train.seq_len=32", "optim.warmup_steps=2"]
    run_small(tmp_path / "run", data, steps=3)
    recs = metrics_by_step(tmp_path / "run")
    assert recs[1]["skipped"] == "no labelled token" and "loss" not in recs[1] and recs[1]["tokens"] == 0
    assert all("skipped" not in recs[s] and recs[s]["tokens"] > 0 for s in (2, 3))
    assert recs[1]["lr"] < recs[2]["lr"]  # warmup moved on through the skipped step
    path = write_jsonl(tmp_path / "masked.jsonl", [long])
    with pytest.raises(TrainingError, match="8 global batches in a row have no token with a label"):
        run_small(tmp_path / "masked", ["data=json", f"data.path={path}", "data.pack=false",
                                        "train.global_batch_size=1"], steps=10)
