"""JSONL text -> Megatron ``.bin``/``.idx`` corpus.

    python -m hyperpar.data.megatron.convert --input data.jsonl --tokenizer TOKENIZER_DIR \\
        --output-prefix out/corpus [--json-key text] [--append-eod] [--workers N]

Each JSON line is one document of one sequence (megatron's preprocess_data.py without
``--split-sentences``). An empty text becomes a document with no sequence and gets no EOD, as
upstream. Unlike preprocess_data.py the prefix is used as given (no ``_text_document`` suffix).
The token dtype is megatron's rule: uint16 when the vocabulary has fewer than 65500 ids, else int32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from multiprocessing import get_context
from typing import Any

import numpy as np

from hyperpar.data.megatron.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path, optimal_dtype
from hyperpar.errors import DataError, HyperparError

_BATCH_LINES = 512

# Worker state: each process loads the tokenizer once.
_TOKENIZER: Any = None
_OPTIONS: dict[str, Any] = {}


def load_tokenizer(path: str) -> Any:
    if not os.path.isdir(path):
        raise DataError(f"{path}: tokenizer directory not found")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None


def _init_worker(tokenizer_dir: str, options: dict[str, Any]) -> None:
    global _TOKENIZER, _OPTIONS
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _TOKENIZER = load_tokenizer(tokenizer_dir)
    _OPTIONS = options


def _encode_batch(batch: tuple[int, list[bytes]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Lines -> (all ids concatenated, ids per document, bytes consumed)."""
    first_line, lines = batch
    key, path = _OPTIONS["json_key"], _OPTIONS["input"]
    texts = []
    for n, raw in enumerate(lines, start=first_line):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                            hint="re-encode the file as UTF-8") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or key not in record:
            raise DataError(f"{path}:{n}: no {key!r} field", hint="choose the field with --json-key")
        if not isinstance(record[key], str):
            raise DataError(f"{path}:{n}: field {key!r} is not a string")
        texts.append(record[key])
    encoded = _TOKENIZER(texts, add_special_tokens=_OPTIONS["add_special_tokens"])["input_ids"]
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths, sum(len(raw) for raw in lines)


def _batches(path: str) -> Iterator[tuple[int, list[bytes]]]:
    with open(path, "rb") as f:
        batch: list[bytes] = []
        start = 1
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are not records
            if not batch:
                start = n
            batch.append(line)
            if len(batch) == _BATCH_LINES:
                yield start, batch
                batch = []
        if batch:
            yield start, batch


def convert(input_path: str, tokenizer_dir: str, output_prefix: str, json_key: str = "text",
            append_eod: bool = False, workers: int = 1, add_special_tokens: bool = False,
            progress: bool = True) -> dict[str, int]:
    """Write ``output_prefix.bin/.idx``; returns counts of documents and tokens."""
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise DataError(f"{input_path}: input file not found")
    tokenizer = load_tokenizer(tokenizer_dir)
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise DataError(f"{tokenizer_dir}: the tokenizer has no eos token to append as EOD")
    dtype = optimal_dtype(len(tokenizer))
    options = {"json_key": json_key, "input": input_path, "add_special_tokens": add_special_tokens}

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    if os.path.exists(get_idx_path(output_prefix)):
        os.unlink(get_idx_path(output_prefix))  # never leave an old index beside a new .bin
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype)
    docs = tokens = 0
    bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, desc="convert",
               disable=not progress or os.environ.get("HYPERPAR_NO_BAR") == "1")
    pool = None
    finished = False
    try:
        if workers > 1:
            pool = get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir, options))
            results = pool.imap(_encode_batch, _batches(input_path), chunksize=1)
        else:
            global _TOKENIZER, _OPTIONS
            _TOKENIZER, _OPTIONS = tokenizer, options
            results = map(_encode_batch, _batches(input_path))
        for flat, lengths, nbytes in results:
            start = 0
            for n in lengths.tolist():
                ids = flat[start:start + n]
                start += n
                if n and append_eod:
                    ids = np.append(ids, eod)
                if ids.size:
                    builder.add_document(ids, [ids.size])
                else:
                    builder.end_document()
                docs += 1
                tokens += ids.size
            bar.update(nbytes)
        finished = True
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
        if not finished:  # a bad line, Ctrl-C, a full disk: leave no partial .bin.tmp<pid>
            builder.abort()
    builder.finalize(get_idx_path(output_prefix))
    return {"documents": docs, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperpar.data.megatron.convert",
                                     description="Tokenize JSONL text into a Megatron .bin/.idx corpus.")
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer directory")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="end every non-empty document with EOS")
    parser.add_argument("--add-special-tokens", action="store_true",
                        help="let the tokenizer add its special tokens (e.g. BOS) to each document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (also HYPERPAR_NO_BAR=1)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        counts = convert(args.input, args.tokenizer, args.output_prefix, args.json_key, args.append_eod,
                         max(1, args.workers), args.add_special_tokens, progress=not args.quiet)
    except HyperparError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or an unwritable output: one line, like the errors above
        print(DataError(f"{e.filename or args.output_prefix}: {e.strerror or e}").one_line(), file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {counts['documents']} documents, "
          f"{counts['tokens']} tokens in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
