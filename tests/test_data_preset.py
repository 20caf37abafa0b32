"""data=preset: LM and vision-language rows from safetensors / .pt files, round trip and collation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hyperpar.data.collate import collate_text
from hyperpar.data.hf import IGNORE_INDEX
from hyperpar.data.loader import DistributedBatchLoader
from hyperpar.data.registry import DataContext, build_dataset
from hyperpar.errors import DataError

IMG, VID = 1000, 1001


def build(path, *, seq_len: int, num_samples: int, vocab: int = 2048, model_args=None, **options):
    ctx = DataContext(seq_len=seq_len, seed=3, num_samples=num_samples, vocab_size=vocab, model_args=model_args)
    return build_dataset("preset", context=ctx, path=str(path), **options)


def lm_tensors(n: int = 5, s: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 900, (n, s), generator=g)
    mask = torch.ones(n, s, dtype=torch.int64)
    mask[2, 7:] = 0  # row 2 is right-padded
    return {"input_ids": ids, "attention_mask": mask}


def test_lm_round_trip_cycles_with_derived_labels(tmp_path):
    t = lm_tensors()
    save_file(t, str(tmp_path / "lm.safetensors"))
    src = build(tmp_path / "lm.safetensors", seq_len=10, num_samples=12)
    assert len(src) == 12 and src.rows == 5 and not hasattr(src, "collate")
    for i in range(12):
        s, r = src[i], i % 5
        # the mask is folded into the labels and passed on; positions restart on every span
        assert set(s) == {"input_ids", "labels", "attention_mask", "position_ids"}
        assert torch.equal(s["attention_mask"], t["attention_mask"][r])
        assert s["position_ids"].tolist() == (list(range(7)) + [0, 1, 2] if r == 2 else list(range(10)))
        assert torch.equal(s["input_ids"], t["input_ids"][r])
        want = torch.cat([t["input_ids"][r, 1:], torch.tensor([IGNORE_INDEX])])
        if r == 2:
            want[6:] = IGNORE_INDEX  # targets 7.. are padding, and so are positions 7..
        assert torch.equal(s["labels"], want), (i, s["labels"], want)


def test_lm_labels_positions_pad_truncate_and_pt(tmp_path):
    t = lm_tensors(n=3, s=8)
    labels = torch.cat([t["input_ids"][:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    labels[0, :3] = IGNORE_INDEX  # a prompt without loss
    pos = torch.arange(8).repeat(3, 1) + 5
    torch.save({"input_ids": t["input_ids"], "labels": labels, "position_ids": pos}, tmp_path / "lm.pt")
    src = build(tmp_path / "lm.pt", seq_len=8, num_samples=3)
    assert torch.equal(src[0]["labels"], labels[0]) and torch.equal(src[1]["position_ids"], pos[1])
    # Hugging Face style labels (labels[t] is token t) are shifted on read.
    torch.save({"input_ids": t["input_ids"], "labels": t["input_ids"]}, tmp_path / "hf_style.pt")
    hf = build(tmp_path / "hf_style.pt", seq_len=8, num_samples=1, extra={"labels_shifted": False})
    assert torch.equal(hf[0]["labels"][:-1], t["input_ids"][0, 1:]) and hf[0]["labels"][-1] == IGNORE_INDEX
    # Longer seq_len: right padding, labels -100, positions keep counting.
    padded = build(tmp_path / "lm.pt", seq_len=11, num_samples=1, extra={"pad_token_id": 7})
    s = padded[0]
    assert s["input_ids"].tolist()[8:] == [7, 7, 7] and (s["labels"][8:] == IGNORE_INDEX).all()
    assert s["position_ids"].tolist() == list(range(5, 16))
    # Shorter seq_len: truncated; the last kept position still predicts the next real token.
    short = build(tmp_path / "lm.pt", seq_len=5, num_samples=2, shuffle=True)
    row = short.row(1)
    assert torch.equal(short[1]["input_ids"], t["input_ids"][row, :5])
    assert short[1]["labels"][-1] == labels[row, 4]


def vl_tensors(d: int = 8) -> dict[str, torch.Tensor]:
    """Row 0: one image (1,4,6) = 6 placeholders. Row 1: images (1,4,4) + (1,2,4) = 4 + 2. Row 2: video (2,4,4) = 8."""
    g = torch.Generator().manual_seed(1)
    s = 24
    ids = torch.randint(0, 900, (3, s), generator=g)
    mm = torch.zeros(3, s, dtype=torch.int32)
    ids[0, 4:10] = IMG
    ids[1, 2:6] = IMG
    ids[1, 12:14] = IMG
    ids[2, 3:7] = VID
    ids[2, 10:14] = VID
    mm[ids == IMG] = 1
    mm[ids == VID] = 2
    pos = torch.arange(s).repeat(3, 3, 1)  # HF layout (3, N, S)
    return {
        "input_ids": ids, "mm_token_type_ids": mm, "position_ids": pos,
        "pixel_values": torch.randn(24 + 16 + 8, d, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 6], [1, 4, 4], [1, 2, 4]]),
        "pixel_values_videos": torch.randn(32, d, generator=g), "video_grid_thw": torch.tensor([[2, 4, 4]]),
    }


@pytest.mark.parametrize("how", ["mm_token_type_ids", "counts", "token_ids"])
def test_vl_round_trip_and_collate(tmp_path, how):
    t = vl_tensors()
    stored = dict(t)
    options: dict = {}
    if how == "counts":
        stored["image_counts"] = torch.tensor([1, 2, 0])
        stored["video_counts"] = torch.tensor([0, 0, 1])
        del stored["mm_token_type_ids"]
    if how == "token_ids":
        del stored["mm_token_type_ids"]
        options["extra"] = {"image_token_id": IMG, "video_token_id": VID}
    save_file(stored, str(tmp_path / "vl.safetensors"))
    src = build(tmp_path / "vl.safetensors", seq_len=24, num_samples=6, **options)
    assert src.is_vl and callable(src.collate)
    s0, s1, s2 = src[0], src[1], src[2]
    assert torch.equal(s0["pixel_values"], t["pixel_values"][:24]) and s0["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(s1["pixel_values"], t["pixel_values"][24:48]) and s1["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert "pixel_values" not in s2 and torch.equal(s2["pixel_values_videos"], t["pixel_values_videos"])
    assert s0["position_ids"].shape == (3, 24)
    if how != "counts":
        assert torch.equal(s2["mm_token_type_ids"], t["mm_token_type_ids"][2])
        # a placeholder is never a target
        assert (s0["labels"][3:9] == IGNORE_INDEX).all() and s0["labels"][9] == t["input_ids"][0, 10]
    batch = src.collate([src[i] for i in range(3)])
    assert torch.equal(batch["pixel_values"], t["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], t["image_grid_thw"])
    assert torch.equal(batch["pixel_values_videos"], t["pixel_values_videos"])
    assert batch["input_ids"].shape == (3, 24) and batch["position_ids"].shape == (3, 3, 24)
    text_only = src.collate([src[2], src[5]])  # rows 2 and 2 again: no image in this micro-batch
    assert "pixel_values" not in text_only and text_only["video_grid_thw"].tolist() == [[2, 4, 4]] * 2


def test_vl_loader_split_over_dp_ranks(tmp_path):
    t = vl_tensors()
    save_file(t, str(tmp_path / "vl.safetensors"))
    save_file({"input_ids": torch.randint(0, 900, (2, 24))}, str(tmp_path / "b.safetensors"))
    # A folder: files in name order (b.safetensors: 2 text rows, then vl.safetensors: 3 VL rows).
    src = build(tmp_path, seq_len=24, num_samples=10)
    assert src.rows == 5
    loaders = [DistributedBatchLoader(src, global_batch_size=4, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    (mb0,), (mb1,) = loaders[0].next_step(), loaders[1].next_step()
    assert "pixel_values" not in mb0  # rows 0, 1: text
    assert mb1["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4], [1, 2, 4]]  # rows 2, 3 = VL rows 0, 1
    # text rows of a VL source carry what VL rows do: zero token types, positions in the same layout
    assert mb0["mm_token_type_ids"].sum() == 0 and mb0["position_ids"].shape == (3, 2, 24)
    (mixed,) = loaders[1].next_step()  # rows 6, 7 = 1, 2: a text row next to a VL row
    assert mixed["image_grid_thw"].tolist() == [[1, 4, 6]] and mixed["position_ids"].shape == (3, 2, 24)


def test_vl_rows_without_positions_share_micro_batches_with_padded_text_rows(tmp_path):
    # VL rows without position_ids (the model computes mRoPE) and a text-only file, all shorter than
    # train.seq_len (so every row gets an attention mask): the text rows must not get 1-D span
    # positions the VL rows lack, or a micro-batch mixing them cannot be collated.
    t = vl_tensors()
    del t["position_ids"]
    save_file(t, str(tmp_path / "vl.safetensors"))
    save_file({"input_ids": torch.randint(0, 900, (2, 24))}, str(tmp_path / "b.safetensors"))
    src = build(tmp_path, seq_len=26, num_samples=10)
    assert src.is_vl
    text, vl = src[0], src[2]
    per_token = {"input_ids", "labels", "attention_mask", "mm_token_type_ids"}
    assert set(text) == per_token and per_token <= set(vl) and "position_ids" not in vl
    assert text["attention_mask"].tolist() == [1] * 24 + [0] * 2
    mixed = src.collate([src[1], src[2]])  # a text row next to a VL row
    assert mixed["input_ids"].shape == (2, 26) and mixed["image_grid_thw"].tolist() == [[1, 4, 6]]


def test_text_file_without_positions_next_to_packed_one(tmp_path):
    # Every sample carries position_ids, so a micro-batch mixing the files keeps the packed rows'
    # document starts (collate_text took the first sample's keys: dropped, or a KeyError).
    ids = torch.randint(0, 900, (2, 16), generator=torch.Generator().manual_seed(0))
    packed = torch.cat([torch.arange(6), torch.arange(10)]).repeat(2, 1)
    save_file({"input_ids": ids, "position_ids": packed}, str(tmp_path / "a.safetensors"))
    save_file({"input_ids": ids}, str(tmp_path / "b.safetensors"))
    src = build(tmp_path, seq_len=16, num_samples=4)
    assert src[2]["position_ids"].tolist() == list(range(16))
    for rows in ([0, 2], [2, 0]):
        batch = collate_text([src[i] for i in rows])
        assert torch.equal(batch["position_ids"][rows.index(0)], packed[0])


def test_vl_file_without_positions_next_to_one_with_them_is_refused(tmp_path):
    # Arange positions for its VL rows would silently replace the mRoPE positions of their images.
    t = vl_tensors()
    save_file(t, str(tmp_path / "a.safetensors"))
    save_file({k: v for k, v in t.items() if k != "position_ids"}, str(tmp_path / "b.safetensors"))
    with pytest.raises(DataError, match="b.safetensors: vision-language rows without position_ids"):
        build(tmp_path, seq_len=24, num_samples=6)


def test_vl_errors(tmp_path):
    t = vl_tensors()
    bad = dict(t)
    bad["image_grid_thw"] = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 2, 2]])  # the last image fills 1 placeholder, not 2
    bad["pixel_values"] = t["pixel_values"][:44]
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(DataError, match="row 1 has 6 image placeholders but its images fill 5"):
        build(tmp_path / "bad.safetensors", seq_len=24, num_samples=1)
    rows = dict(t)
    rows["pixel_values"] = t["pixel_values"][:40]
    save_file(rows, str(tmp_path / "rows.safetensors"))
    with pytest.raises(DataError, match="has 40 rows but image_grid_thw accounts for 48"):
        build(tmp_path / "rows.safetensors", seq_len=24, num_samples=1)
    save_file(t, str(tmp_path / "ok.safetensors"))
    with pytest.raises(DataError, match="do not fit train.seq_len=16"):
        build(tmp_path / "ok.safetensors", seq_len=16, num_samples=1)
    with pytest.raises(DataError, match="vocabulary has 500 ids"):
        build(tmp_path / "ok.safetensors", seq_len=24, num_samples=1, vocab=500)
    with pytest.raises(DataError, match="does not exist"):
        build(tmp_path / "nope.safetensors", seq_len=24, num_samples=1)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="cannot read"):
        build(tmp_path / "junk.pt", seq_len=24, num_samples=1)
