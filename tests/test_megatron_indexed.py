"""Megatron .bin/.idx reader and writer, and the JSONL converter."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyperpar.data.megatron import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from hyperpar.errors import DataError

SRC = Path(__file__).resolve().parents[1] / "src"


def write_corpus(prefix: Path, docs: list[list[list[int]]], dtype=np.uint16, multimodal: bool = False) -> str:
    """``docs`` = documents, each a list of sequences (an empty list = a zero-sequence document)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        for k, seq in enumerate(doc):
            builder.add_item(np.array(seq, dtype=np.int64), *( [k % 3] if multimodal else []))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


DOCS = [[[5, 6, 7]], [], [[8], [], [9, 10]], [[11, 12, 13, 14]], [[]]]


def test_worked_example_is_byte_exact(tmp_path: Path) -> None:
    # MEGATRON_FORMAT.md 3.4: [5,6,7] as one sequence; [8], [9,10] as one document of two sequences.
    prefix = write_corpus(tmp_path / "ex", [[[5, 6, 7]], [[8], [9, 10]]])
    idx = Path(prefix + ".idx").read_bytes()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + b"\x08" + struct.pack("<QQ", 3, 3)
                + struct.pack("<3i", 3, 1, 2) + struct.pack("<3q", 0, 6, 8) + struct.pack("<3q", 0, 1, 3))
    assert len(idx) == 94 and idx == expected
    assert Path(prefix + ".bin").read_bytes() == bytes.fromhex("050006000700080009000a00")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_round_trip(tmp_path: Path, dtype) -> None:
    prefix = write_corpus(tmp_path / "c", DOCS, dtype=dtype)
    ds = IndexedDataset(prefix)
    seqs = [s for doc in DOCS for s in doc]
    assert len(ds) == len(seqs) == 6
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    assert ds.document_indices.tolist() == [0, 1, 1, 4, 5, 6]
    assert ds.document_count == 5
    for i, seq in enumerate(seqs):
        assert ds[i].tolist() == seq and ds[i].dtype == np.dtype(dtype)
    assert ds[-3].tolist() == [9, 10]
    assert [a.tolist() for a in ds[1:4]] == [[8], [], [9, 10]]
    assert ds.get(4, offset=1, length=2).tolist() == [12, 13]
    assert ds.get(4, offset=2).tolist() == [13, 14]
    with pytest.raises(IndexError):
        ds.get(4, offset=3, length=2)
    with pytest.raises(IndexError):
        ds[6]
    with pytest.raises(ValueError):
        ds[0:4:2]


def test_reads_are_zero_copy_views(tmp_path: Path) -> None:
    ds = IndexedDataset(write_corpus(tmp_path / "c", DOCS))
    seq = ds[4]
    assert np.shares_memory(seq, ds.tokens)
    assert not seq.flags.writeable


def test_pickles_by_path(tmp_path: Path) -> None:
    ds = IndexedDataset(write_corpus(tmp_path / "c", [[list(range(1000))]] * 50))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the mapped tokens are not copied into DataLoader workers
    again = pickle.loads(blob)
    assert again[7].tolist() == ds[7].tolist()


def test_empty_corpus(tmp_path: Path) -> None:
    ds = IndexedDataset(write_corpus(tmp_path / "e", []))
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_multimodal_modes(tmp_path: Path) -> None:
    prefix = write_corpus(tmp_path / "m", [[[1, 2], [3]], [[4]]], multimodal=True)
    ds = IndexedDataset(prefix)  # detected from the file size
    assert ds.multimodal and ds.sequence_modes.tolist() == [0, 1, 0]
    with pytest.raises(DataError):
        IndexedDataset(prefix, multimodal=False)
    plain = write_corpus(tmp_path / "p", [[[1, 2]]])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(plain, multimodal=True)


def test_add_document_and_add_index_merge(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", [[[1, 2, 3]], [], [[4], [5, 6]]], dtype=np.int32)
    b = write_corpus(tmp_path / "b", [[[7]], [[8, 9], []]], dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    builder.add_document(np.array([100, 101, 102]), [1, 2])
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert [merged[i].tolist() for i in range(len(merged))] == [
        [100], [101, 102], [1, 2, 3], [4], [5, 6], [7], [8, 9], []]
    assert merged.document_indices.tolist() == [0, 2, 3, 3, 5, 6, 8]
    assert merged.sequence_pointers.tolist() == [0, 4, 12, 24, 28, 36, 40, 48]

    other = write_corpus(tmp_path / "u16", [[[1]]], dtype=np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.int32)
    with pytest.raises(DataError, match="dtype"):
        builder.add_index(other)


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.uint16)
    with pytest.raises(DataError, match="70000"):
        builder.add_item(np.array([1, 70000]))  # megatron would wrap this to 4464
    with pytest.raises(DataError, match="do not cut"):
        builder.add_document([1, 2, 3], [1, 1])
    builder.add_item([1, 2])
    with pytest.raises(DataError, match="after the last end_document"):
        builder.finalize(str(tmp_path / "w.idx"))
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def _corrupt(prefix: str, how: str) -> None:
    idx, binp = Path(prefix + ".idx"), Path(prefix + ".bin")
    data = bytearray(idx.read_bytes())
    if how == "magic":
        data[:9] = b"TNTIDX\x00\x00\x00"
    elif how == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif how == "dtype":
        data[17] = 9
    elif how == "truncated_header":
        data = data[:20]
    elif how == "truncated_arrays":
        data = data[:-5]
    elif how == "trailing":
        data += b"\x00" * 3
    elif how == "doc_end":
        data[-8:] = struct.pack("<q", 99)
    elif how == "bin_short":
        binp.write_bytes(binp.read_bytes()[:-2])
    elif how == "pointer":
        s = struct.unpack_from("<Q", data, 18)[0]
        struct.pack_into("<q", data, 34 + 4 * s + 8 * (s - 1), 10_000)
    idx.write_bytes(bytes(data))


@pytest.mark.parametrize("how, words", [
    ("magic", "bad magic"), ("version", "version 2"), ("dtype", "dtype code 9"),
    ("truncated_header", "truncated"), ("truncated_arrays", "truncated"), ("trailing", "trailing"),
    ("doc_end", "document indices"), ("bin_short", "past the end"), ("pointer", "past the end"),
])
def test_corrupt_index_is_one_line_data_error(tmp_path: Path, how: str, words: str) -> None:
    prefix = write_corpus(tmp_path / "c", DOCS)
    _corrupt(prefix, how)
    with pytest.raises(DataError) as err:
        IndexedDataset(prefix)
    line = err.value.one_line()
    assert "\n" not in line and prefix + ".idx" in line and words in line


def test_missing_files_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        IndexedDataset(str(tmp_path / "nothing"))
    prefix = write_corpus(tmp_path / "c", DOCS)
    os.unlink(prefix + ".bin")
    with pytest.raises(DataError, match=r"\.bin"):
        IndexedDataset(prefix)


# -- JSONL -> corpus ------------------------------------------------------------------------------

LINES = ["the cat sat on the mat", "", "a dog sat", "the mat is red and the cat is not"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return str(path)


def _jsonl(path: Path, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(LINES)))
    return path


def test_convert_reads_back_tokenizer_ids(tmp_path: Path, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    from hyperpar.data.megatron.convert import main

    src = _jsonl(tmp_path / "in.jsonl", key="body")
    assert main(["--input", str(src), "--tokenizer", tokenizer_dir, "--output-prefix",
                 str(tmp_path / "out" / "c"), "--json-key", "body", "--append-eod", "--quiet"]) == 0
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ds = IndexedDataset(str(tmp_path / "out" / "c"))
    expected = [tok(t, add_special_tokens=False)["input_ids"] for t in LINES]
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == [ids + [tok.eos_token_id] for ids in expected if ids]
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3]  # the empty line is a zero-sequence document


def test_convert_errors_are_one_line(tmp_path: Path, tokenizer_dir: str, capsys) -> None:
    from hyperpar.data.megatron.convert import main

    src = _jsonl(tmp_path / "in.jsonl")
    rc = main(["--input", str(src), "--tokenizer", tokenizer_dir, "--output-prefix",
               str(tmp_path / "c"), "--json-key", "missing", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "in.jsonl:1" in err and "missing" in err


@pytest.mark.slow  # three interpreters importing transformers
def test_convert_module_entry_with_workers(tmp_path: Path, tokenizer_dir: str) -> None:
    src = _jsonl(tmp_path / "in.jsonl")
    out = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "hyperpar.data.megatron.convert", "--input", str(src),
                           "--tokenizer", tokenizer_dir, "--output-prefix", str(out), "--workers", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(str(out))
    assert len(ds) == 3 and ds.document_count == 4  # no EOD appended without --append-eod
