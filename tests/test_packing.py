"""Packed documents: a position restarting at 0 starts a new document, and attention, the GatedDeltaNet
state and its causal conv stay inside each one; padding (attention_mask 0) is a span of its own and
leaves the router statistics. Kernels against each document alone and the token-by-token
reference; every family's logits against each document run alone; data types emitting the
boundaries; single vs fsdp2 training on packed data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import perturb_, read_losses, run_cli
from hyperpar.models.layers import (
    Documents,
    GatedDeltaRule,
    attention_core,
    causal_depthwise_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from hyperpar.models.output import ModelOutput
from hyperpar.models.spec import get_model_spec

torch.set_num_threads(1)

ROWS = [(70, 58), (5, 130, 9), (1, 127)]  # documents per row
PAD = {0: "left", 2: "right"}  # rows padded to the longest (144) with attention_mask 0
S_MAX = max(sum(r) for r in ROWS)


def doc_positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def packed_batch(ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """input_ids, position_ids (restarting per document and per padding run), attention_mask."""
    rows_ids, rows_pos, rows_mask = [], [], []
    for r, (lengths, row) in enumerate(zip(ROWS, ids)):
        pad = S_MAX - sum(lengths)
        pos, mask = doc_positions(lengths), torch.ones(sum(lengths), dtype=torch.int64)
        fill = (torch.full((pad,), 5), torch.arange(pad), torch.zeros(pad, dtype=torch.int64))
        parts = [(row, pos, mask), fill] if PAD.get(r) == "right" else [fill, (row, pos, mask)]
        rows_ids.append(torch.cat([p[0] for p in parts]))
        rows_pos.append(torch.cat([p[1] for p in parts]))
        rows_mask.append(torch.cat([p[2] for p in parts]))
    return {"input_ids": torch.stack(rows_ids), "position_ids": torch.stack(rows_pos),
            "attention_mask": torch.stack(rows_mask)}


def real_start(r: int) -> int:
    return S_MAX - sum(ROWS[r]) if PAD.get(r) == "left" else 0


# --- the descriptor --------------------------------------------------------------------------------


def test_documents_from_positions():
    assert Documents.from_positions(None) is None
    assert Documents.from_positions(torch.arange(8).expand(2, 8)) is None  # one document per row: fast path
    pos = torch.stack([doc_positions((3, 5)), doc_positions((8,))])
    doc = Documents.from_positions(pos)
    assert doc.lengths == [3, 5, 8] and doc.cu_seqlens.tolist() == [0, 3, 8, 16] and doc.max_seqlen == 8
    assert doc.segment_ids[0].tolist() == [0] * 3 + [1] * 5 and doc.offsets[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    # 4-row positions: the text row carries the boundaries; 3-row (T, H, W) carries none
    four = torch.stack([pos, torch.zeros_like(pos), pos, pos])
    assert Documents.from_positions(four).lengths == [3, 5, 8]
    assert Documents.from_positions(four[1:]) is None
    # padding is a span of its own, wherever it is
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]])
    assert Documents.from_positions(None, mask).lengths == [2, 4, 2]
    assert Documents.from_positions(None, torch.ones(1, 8)) is None
    # the MTP stream: a row straddling a boundary is a document of its own
    mtp = Documents.from_positions(doc_positions((3, 5)).unsqueeze(0)).shifted_for_mtp()
    assert mtp.lengths == [2, 1, 4]


# --- kernels -----------------------------------------------------------------------------------------


def _alone(fn, x_list, rows=ROWS):
    """fn applied to each document slice of (B, S, ...) tensors, reassembled."""
    B = x_list[0].shape[0]
    out = None
    for b in range(B):
        s0 = 0
        for n in rows[b]:
            y = fn(*(t[b : b + 1, s0 : s0 + n] for t in x_list))
            if out is None:
                out = y.new_zeros((B, x_list[0].shape[1], *y.shape[2:]))
            out[b : b + 1, s0 : s0 + n] = y
            s0 += n
    return out


ROWS_EQ = [(70, 58), (5, 114, 9), (1, 127)]  # equal row lengths (128) for kernel tests


def _doc_eq() -> Documents:
    return Documents.from_positions(torch.stack([doc_positions(r) for r in ROWS_EQ]))


def test_gated_delta_rule_restarts_at_documents():
    g = torch.Generator().manual_seed(0)
    B, S, nk, nv, dk, dv = 3, 128, 2, 4, 16, 8
    q, k = (torch.randn(B, S, nk, dk, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, S, nv, dv, generator=g).requires_grad_()
    a = (torch.rand(B, S, nv, generator=g) * 4).requires_grad_()
    beta = torch.rand(B, S, nv, generator=g).requires_grad_()
    doc = _doc_eq()
    inputs = (q, k, v, a, beta)

    def run(q, k, v, a, beta, **kw):
        return chunk_gated_delta_rule(q, k, v, -a, beta, 32, **kw)

    packed = run(*inputs, segment_ids=doc.segment_ids)
    alone = _alone(run, inputs, ROWS_EQ)
    ref = recurrent_gated_delta_rule(q, k, v, -a, beta, segment_ids=doc.segment_ids)
    assert (packed - alone).abs().max() < 1e-5 and (packed - ref).abs().max() < 1e-5
    assert (run(*inputs) - alone).abs().max() > 1e-3  # without the boundaries the state leaks
    w = torch.randn(packed.shape, generator=g)
    got = torch.autograd.grad((packed * w).sum(), inputs)
    want = torch.autograd.grad((alone * w).sum(), inputs)
    for x, y in zip(got, want):
        assert (x - y).abs().max() < 1e-5
    # documents as long as a chunk, and starts on chunk edges
    rows = [(32, 32, 64), (64, 1, 63), (31, 1, 96)]
    d2 = Documents.from_positions(torch.stack([doc_positions(r) for r in rows]))
    got = run(*inputs, segment_ids=d2.segment_ids)
    assert (got - _alone(run, inputs, rows)).abs().max() < 1e-5


@pytest.mark.parametrize("silu", [True, False])
def test_causal_conv_stays_inside_documents(silu):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, 12, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(12, 1, 4, generator=g, dtype=torch.float64).requires_grad_()
    doc = _doc_eq()
    got = causal_depthwise_conv1d(x, w, silu=silu, doc=doc)
    want = _alone(lambda t: causal_depthwise_conv1d(t, w, silu=silu), [x], ROWS_EQ)
    assert (got - want).abs().max() < 1e-12
    assert (causal_depthwise_conv1d(x, w, silu=silu) - want).abs().max() > 1e-3
    dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy)):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("impl", ["auto", "split", "mask"])
def test_attention_is_block_causal(impl):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 128, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(3, 128, 2, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    doc = _doc_eq()
    got = attention_core(q, k, v, scale=0.3, doc=doc, doc_impl=impl)
    want = _alone(lambda a, b, c: attention_core(a, b, c, scale=0.3), [q, k, v], ROWS_EQ)
    assert (got - want).abs().max() < 1e-12
    dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
        assert (a - b).abs().max() < 1e-12


def test_varlen_without_enable_gqa_repeats_each_kv_head_for_its_query_heads(monkeypatch):
    """torch before 2.13 has no ``enable_gqa`` in ``varlen_attn`` (seen on an H200 with torch 2.11): each
    k/v head is then repeated for the query heads it serves. A stand-in for the CUDA-only kernel that
    refuses grouped heads checks the repeat against the per-document path on CPU."""
    import torch.nn.functional as F
    from torch.nn.attention import varlen

    from hyperpar.models.layers import attention

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **kw):
        assert "enable_gqa" not in kw and k.shape[1] == q.shape[1] == v.shape[1] and window_size == (-1, 0)
        bounds = cu_q.tolist()
        outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                               scale=scale).transpose(0, 1) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen)
    monkeypatch.setattr(attention, "_varlen_has_gqa", lambda: False)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 128, 8, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 128, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    doc = _doc_eq()
    got = attention_core(q, k, v, scale=0.3, doc=doc, doc_impl="varlen")
    want = attention_core(q, k, v, scale=0.3, doc=doc, doc_impl="split")
    assert (got - want).abs().max() < 1e-12


def test_head_sharded_recurrence_sees_the_same_documents():
    """Tensor parallelism hands the kernel a subset of heads with the whole sequence: the slice of
    the full output, boundaries included."""
    g = torch.Generator().manual_seed(3)
    B, S, nk, nv, dk, dv, K = 3, 128, 2, 4, 8, 8, 4
    q, k = (torch.randn(B, S, nk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, S, nv, dv, generator=g)
    a, beta = torch.rand(B, S, nv, generator=g), torch.rand(B, S, nv, generator=g)
    cq, ck = (torch.randn(nk * dk, K, generator=g) for _ in range(2))
    cv = torch.randn(nv * dv, K, generator=g)
    doc, rule = _doc_eq(), GatedDeltaRule(32)
    full = rule(q, k, v, -a, beta, cq, ck, cv, doc=doc)
    half = rule(q[:, :, :1], k[:, :, :1], v[:, :, :2], -a[..., :2], beta[..., :2], cq[:dk], ck[:dk], cv[: 2 * dv], doc=doc)
    assert (half - full[:, :, :2]).abs().max() < 1e-6


# --- every family: a packed row equals each document alone ---------------------------------------------


FAMILIES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_vl_moe"]


def build(name: str, seed: int = 0):
    spec = get_model_spec(name)
    args = spec.args_for("debug")
    if hasattr(args, "mtp_loss_weight"):  # run the MTP module too (its stream has its own boundaries)
        args = dataclasses.replace(args, mtp_loss_weight=0.5)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = torch.empty(p.shape)
            model.init_param(n, full, gen)
            p.copy_(full)
    perturb_(model, seed)
    return model.eval()


def _outputs(out) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if isinstance(out, ModelOutput):
        return out.logits, out.aux_loss, out.mtp_logits
    return out, None, None


def run_alone(model, ids: torch.Tensor):
    """One document as its own batch; a 1-token document has no MTP stream (MTP needs S ≥ 2)."""
    args = model.args
    if ids.numel() == 1 and hasattr(args, "mtp_loss_weight"):
        model.args = dataclasses.replace(args, mtp_loss_weight=0.0)
    try:
        return model(ids.unsqueeze(0))
    finally:
        model.args = args


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_logits_equal_each_document_alone(name):
    model = build(name)
    vl = "vl" in name
    vocab = 900
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(10, vocab, (sum(r),), generator=g) for r in ROWS]
    batch = packed_batch(ids)
    if vl:  # the 4-row (text, T, H, W) form: boundaries in the text row
        batch["position_ids"] = batch["position_ids"].unsqueeze(0).expand(4, -1, -1)
    with torch.no_grad():
        logits, aux, mtp = _outputs(model(**batch))
        for r, lengths in enumerate(ROWS):
            s0 = real_start(r)
            for n in lengths:
                alone, _, alone_mtp = _outputs(run_alone(model, ids[r][s0 - real_start(r) : s0 - real_start(r) + n]))
                diff = (logits[r, s0 : s0 + n] - alone[0]).abs().max().item()
                assert diff <= 1e-5, (name, r, n, diff)
                if mtp is not None and n > 1:  # MTP row t reads tokens t and t+1 of the same document
                    mdiff = (mtp[r, s0 : s0 + n - 1] - alone_mtp[0]).abs().max().item()
                    assert mdiff <= 1e-5, (name, "mtp", r, n, mdiff)
                s0 += n
        # the test can fail: without boundaries the documents see each other
        plain = {"input_ids": batch["input_ids"]}
        leaked, _, _ = _outputs(model(**plain))
        assert (leaked[1, 5:135] - logits[1, 5:135]).abs().max() > 1e-4
        if aux is not None:  # padding leaves the router statistics: other pad ids, same aux loss
            # (equal up to the rounding of expert GEMMs whose row counts the padding changes)
            other = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 77))
            assert abs(_outputs(model(**other))[1] / aux - 1) < 1e-6
            unmasked = {k: v for k, v in other.items() if k != "attention_mask"}
            assert abs(_outputs(model(**unmasked))[1] / aux - 1) > 1e-4


def _doc_labels(ids: torch.Tensor) -> torch.Tensor:
    """One document's pre-shifted labels: the next token, none after its last."""
    return torch.cat([ids[1:], ids.new_full((1,), -100)])


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_moe_vl"])
def test_packed_mtp_loss_and_router_statistics_equal_each_document_alone(name):
    """The MTP stream row that joins two documents (the last token's state, the next document's
    first embedding) or touches padding exists for no document alone: its target is not trained or
    counted, and its token is left out of the router statistics."""
    from hyperpar.train.objective import Objective, StepTotals

    model = build(name)
    objective = Objective(mtp_weight=0.5)
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(10, 900, (sum(r),), generator=g) for r in ROWS]
    batch = packed_batch(ids)
    labels = torch.full_like(batch["input_ids"], -100)
    for r, lengths in enumerate(ROWS):
        s0 = real_start(r)
        for n in lengths:
            labels[r, s0 : s0 + n] = _doc_labels(batch["input_ids"][r, s0 : s0 + n])
            s0 += n
    if "vl" in name:
        batch["position_ids"] = batch["position_ids"].unsqueeze(0).expand(4, -1, -1)
    targets = objective.targets(labels, batch["position_ids"], batch["attention_mask"])
    mtp_tokens = objective.totals([targets], 1, lambda t: t).mtp_tokens
    with torch.no_grad():
        out = model(**batch)
        totals = StepTotals(tokens=torch.tensor(1.0), micro_batches=1, mtp_tokens=torch.tensor(1.0))
        mtp_sum = objective(out, targets, totals)[1].mtp_sum
        alone_sum, alone_tokens, alone_rows, alone_counts = 0.0, 0, 0.0, 0
        for r, lengths in enumerate(ROWS):
            s0 = 0
            for n in lengths:
                doc = ids[r][s0 : s0 + n]
                s0 += n
                one = run_alone(model, doc)
                one_labels = _doc_labels(doc).unsqueeze(0)
                stats = one.router_stats
                alone_rows += stats.tokens.item()
                alone_counts = alone_counts + stats.counts
                if n > 1:
                    t = objective.targets(one_labels)
                    alone_sum += objective(one, t, totals)[1].mtp_sum.item()
                    alone_tokens += int((objective.mtp_labels(t) != -100).sum())
    assert mtp_tokens.item() == alone_tokens == sum(max(n - 2, 0) for r in ROWS for n in r)
    assert abs(mtp_sum.item() / alone_sum - 1) < 1e-5, (mtp_sum.item(), alone_sum)
    assert out.router_stats.tokens.item() == alone_rows
    assert torch.equal(out.router_stats.counts, alone_counts)


def test_unpacked_rows_take_the_fast_path(monkeypatch):
    """Plain positions give no descriptor: the kernels run exactly as without packing."""
    model = build("qwen3_5")
    seen = []
    core = type(model.model.layers["1"].self_attn.core)
    orig = core.forward

    def spy(self, q, k, v, *, doc=None):
        seen.append(doc)
        return orig(self, q, k, v, doc=doc)

    monkeypatch.setattr(core, "forward", spy)
    ids = torch.randint(0, 900, (2, 40))
    with torch.no_grad():
        a = model(ids)
        b = model(ids, position_ids=torch.arange(40).expand(2, 40), attention_mask=torch.ones(2, 40))
    assert torch.equal(a, b) and seen and all(d is None for d in seen)


# --- data types emit the boundaries --------------------------------------------------------------------


def test_json_packing_restarts_positions_at_documents(tmp_path):
    from hyperpar.data.registry import DataContext, build_dataset

    ctx = DataContext(seq_len=64, seed=0, num_samples=6, vocab_size=2048)
    src = build_dataset("json", context=ctx, path="pkg://hyperpar.data/corpus/shakespeare.jsonl",
                        tokenizer="pkg://hyperpar.data/corpus/tokenizer", shuffle=False)
    offsets = set(src.docs.offsets.tolist())
    for i in range(6):
        s = src[i]
        a = src.unit(i) * 65
        pos = s["position_ids"].tolist()
        assert pos[0] == 0 and all((p == 0) == (a + t in offsets) for t, p in enumerate(pos) if t)
        assert all(p == q + 1 for t, (q, p) in enumerate(zip(pos, pos[1:])) if p)


def test_megatron_reset_attention_mask_emits_boundaries(tmp_path):
    from hyperpar.data.megatron.indexed import IndexedDatasetBuilder
    from hyperpar.data.megatron.source import MegatronSource

    eod = 2
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=np.int32)
    for n in range(3, 30):
        builder.add_item(np.append(np.arange(10, 10 + n), eod))
        builder.end_document()
    builder.finalize(str(tmp_path / "c.idx"))
    src = MegatronSource(prefix=str(tmp_path / "c"), seq_len=32, num_samples=8, eod_token_id=eod,
                         reset_attention_mask=True)
    for i in range(8):
        item = src[i]
        assert set(item) == {"input_ids", "labels", "position_ids"}
        ids, pos = item["input_ids"].tolist(), item["position_ids"].tolist()
        assert pos[0] == 0 and all((p == 0) == (ids[t - 1] == eod) for t, p in enumerate(pos) if t)


# --- training on packed data: single == fsdp2 ---------------------------------------------------------


def _megatron_reset(root: Path) -> list[str]:
    from hyperpar.data.hf import resolve_path
    from hyperpar.data.megatron.convert import convert

    convert(resolve_path("pkg://hyperpar.data/corpus/shakespeare.jsonl"), resolve_path("pkg://hyperpar.data/corpus/tokenizer"),
            str(root / "corpus"), append_eod=True, progress=False)
    return ["data=megatron", f"data.prefix={root / 'corpus'}", f"data.cache_dir={root / 'idx'}",
            "data.tokenizer=pkg://hyperpar.data/corpus/tokenizer",
            "data.extra.reset_position_ids=true", "data.extra.reset_attention_mask=true"]


@pytest.mark.slow
# json packing also trains under cp2 in the CP tests (packed documents' gradients), so CI keeps Megatron's here
@pytest.mark.parametrize("make", [_megatron_reset, pytest.param(lambda root: ["data=json"], marks=pytest.mark.full)],
                         ids=["megatron_reset", "json_pack"])
def test_packed_training_single_vs_fsdp2_and_cp2(tmp_path, make):
    """Packed rows train alike under single, fsdp2 and cp2 (documents cross the cp shard edge: the
    kernels see whole-row documents after the all-to-all)."""
    data_args = make(tmp_path)
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "parallel=single,fsdp2,cp2", "+experiment=parity", "train.steps=3", "train.seq_len=64",
                   "train.global_batch_size=4", "train.micro_batch_size=2", "launch.threads_per_rank=1",
                   *data_args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    base = read_losses(sweep / "0")
    for job in ("1", "2"):
        other = read_losses(sweep / job)
        assert sorted(base) == sorted(other) == [1, 2, 3]
        assert max(abs(base[s] - other[s]) for s in base) <= 1e-5, job


def test_vl_pipeline_inputs_keep_packed_document_starts():
    """Under pp the VL step inputs became 3-row (T, H, W) positions, which carry no document starts:
    every stage then ran packed text rows as one document (attention, GatedDeltaNet state and conv)."""
    from hyperpar.distributed import pipeline_vl
    from hyperpar.models.layers.documents import Documents
    from hyperpar.models.spec import get_model_spec

    args = get_model_spec("qwen3_vl_moe").args_for("debug")
    pos = torch.cat([torch.arange(32), torch.arange(32)]).unsqueeze(0)
    mb = {"input_ids": torch.randint(10, 900, (1, 64)), "labels": torch.randint(10, 900, (1, 64)), "position_ids": pos}
    rows, _ = pipeline_vl.step_inputs([mb], args)
    assert rows["position_ids"].shape == (4, 1, 64)
    assert Documents.from_positions(rows["position_ids"]).lengths == [32, 32]
    plain, _ = pipeline_vl.step_inputs([{k: v for k, v in mb.items() if k != "position_ids"}], args)
    assert Documents.from_positions(plain["position_ids"]) is None  # unpacked rows stay on the fast path
