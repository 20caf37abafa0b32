"""Text and chat data through Hugging Face ``datasets``: ``data=hf`` and ``data=json``.

``data.path`` is a directory written by ``save_to_disk``, a data file (JSON/JSONL, Parquet, Arrow,
CSV, text) or a folder or glob of them, or a hub dataset name where the network allows.
``data=json`` is the same builder with ``format: json``; by default it reads the packaged
public-domain corpus with its tokenizer (``pkg://`` paths resolve inside an installed package).

The builder tokenizes once. Each document becomes a token run ending in EOS; for text every token
is a target, for chat (a ``messages`` column of ``{role, content}``, rendered with the tokenizer's
chat template) only the assistant turns are. Empty documents are dropped. The runs are cached under
``data.cache_dir`` (else ``<run dir>/data_cache``) under a fingerprint of the data files, the
tokenizer files and the options; a file lock lets the first rank build while the others wait and
then memory-map the same files.

``pack: true`` concatenates the runs in corpus order and cuts them into blocks of ``seq_len + 1``
tokens (the tail that fills no block is dropped), with ``position_ids`` restarting at 0 at every
document start so the models keep the documents apart (the EOS still predicts the next
document's first token, as Megatron's packing does); ``pack: false`` makes one sample per document,
truncated or right-padded with labels -100. Sample ``i`` is unit ``perm_e[i mod U]`` of epoch
``e = i div U`` (U units, ``perm_e`` seeded by the seed and ``e``; the identity with
``shuffle: false``): the source has exactly ``ctx.num_samples`` samples and each is a pure function
of ``i``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyperpar.data.registry import DataContext, register_dataset
from hyperpar.errors import DataError

log = logging.getLogger("hyperpar")

IGNORE_INDEX = -100
CACHE_FORMAT = "hyperpar.data.hf/1"
PKG_PREFIX = "pkg://"
_FORMATS = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet",
            ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
_TOKENIZE_BATCH = 1024


# -- paths and tokenizer --------------------------------------------------------------------------

def resolve_path(path: str | os.PathLike | None) -> str | None:
    """``pkg://package/rel/path`` -> the file inside the installed package; ``~`` expanded; else as given."""
    if path is None:
        return None
    path = str(path)
    if path.startswith(PKG_PREFIX):
        from importlib.resources import files

        package, _, rel = path[len(PKG_PREFIX):].partition("/")
        try:
            root = files(package)
        except ModuleNotFoundError:
            raise DataError(f"{path}: no installed package {package!r}") from None
        return str(Path(str(root)) / rel)
    return os.path.expanduser(path)


def load_tokenizer(path: str | None) -> Any:
    """A transformers tokenizer from a local directory (``pkg://`` allowed); never the network."""
    if not path:
        raise DataError("data.tokenizer is not set", hint="give a local tokenizer directory, e.g. data.tokenizer=/ckpt/Qwen3.5-0.8B")
    local = resolve_path(path)
    if not os.path.isdir(local):
        raise DataError(f"tokenizer directory {path!r} does not exist", hint="data.tokenizer must be a local directory")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(local, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"cannot load a tokenizer from {path!r} ({str(e).splitlines()[0]})") from None


def _tokenizer_fingerprint(path: str | None) -> str:
    """Hash of every file of the tokenizer directory (vocabulary, merges, special tokens, chat template)."""
    local = resolve_path(path)
    if not local or not os.path.isdir(local):
        load_tokenizer(path)  # raises the user error
    h = hashlib.blake2b(digest_size=16)
    root = Path(local)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _files_fingerprint(paths: list[str]) -> str:
    """Names, sizes and mtimes of every data file: a rewritten file never matches an old cache."""
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _local_files(path: str) -> list[str] | None:
    """Every data file behind a local path (file, folder or glob), or None when it is not local."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and ".cache" not in p.parts)
    if glob.has_magic(path):
        return sorted(glob.glob(path, recursive=True)) or None
    return None


def _format_of(path: str) -> str | None:
    name = path.lower()
    for ext in sorted(_FORMATS, key=len, reverse=True):
        if name.endswith(ext):
            return _FORMATS[ext]
    return None


# -- reading records ------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    # datasets logs a failed read itself (twice, through Hydra's root handler); our DataError says it once.
    ds_log = logging.getLogger("datasets")
    level = ds_log.level
    ds_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        ds_log.setLevel(level)
        if was_enabled:
            datasets.enable_progress_bars()


def diagnose_json(files: list[str]) -> DataError | None:
    """After datasets failed (or a string would not decode): the first empty file, non-UTF-8 byte or
    invalid JSON line, named by file and line. Reads the files only on this error path."""
    for path in files:
        records = 0
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                                     hint="re-encode the file as UTF-8")
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    if records == 0 and path.lower().endswith(".json"):
                        return _diagnose_whole_json(path)  # one JSON document, not JSON lines
                    return DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})")
                records += 1
        if records == 0:
            return DataError(f"{path}: the file holds no records", hint="give a JSONL file with one JSON object per line")
    return None


def _diagnose_whole_json(path: str) -> DataError | None:
    try:
        json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})")
    return None


def _json_files(options: dict[str, Any]) -> list[str]:
    path = resolve_path(options.get("path")) if options.get("path") else None
    files = _local_files(path) if path else None
    fmt = options.get("format")
    return [f for f in files or [] if (fmt or _format_of(f)) == "json"]


def load_records(options: dict[str, Any], cache_dir: str) -> Any:
    """The ``datasets.Dataset`` that ``data.path`` / ``format`` / ``split`` / ``max_samples`` name."""
    import datasets

    raw = options.get("path")
    if not raw:
        raise DataError("data.path is not set", hint="give a dataset directory, a data file or a hub dataset name")
    path = resolve_path(raw)
    fmt = options.get("format")
    split = options.get("split") or "train"
    extra = options.get("extra") or {}
    try:
        with _quiet_datasets():
            if fmt == "disk" or (os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                                              for f in ("state.json", "dataset_dict.json"))):
                ds = datasets.load_from_disk(path)
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise DataError(f"{raw}: no split {split!r} (splits: {', '.join(ds)})", hint="set data.split")
                    ds = ds[split]
                elif split != "train":  # a plain Dataset has no splits: the whole of it would be read
                    raise DataError(f"{raw}: a save_to_disk Dataset without splits; data.split={split!r} cannot "
                                    "select from it", hint="leave data.split=train (all rows), or use data.max_samples")
            elif (files := _local_files(path)) is not None:
                builder = fmt or next((_format_of(f) for f in files if _format_of(f)), None)
                if os.path.isdir(path):  # a folder: its files of that format (not READMEs, licences, ...)
                    files = [f for f in files if _format_of(f) == builder]
                if builder is None or not files:
                    raise DataError(f"{raw}: no data files of a known format",
                                    hint=f"name the format with data.format ({', '.join(sorted(set(_FORMATS.values())))})")
                ds = datasets.load_dataset(builder, data_files=files, split=split, cache_dir=cache_dir)
            else:
                ds = _load_hub(raw, split, extra, cache_dir)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "cannot read this data"
        found = diagnose_json(_json_files(options))
        if found is not None:
            raise found from None
        raise DataError(f"cannot load dataset {raw!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    max_samples = options.get("max_samples")
    if max_samples is not None:
        ds = ds.select(range(min(int(max_samples), len(ds))))
    return ds


def _load_hub(name: str, split: str, extra: dict, cache_dir: str) -> Any:
    import datasets

    if name.startswith((".", "/", "~", PKG_PREFIX)) or os.path.isabs(name):
        raise DataError(f"data.path {name!r} does not exist")
    if any(os.environ.get(v, "0").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise DataError(f"{name!r} is not a local path and the hub is disabled (HF_HUB_OFFLINE)",
                        hint="give a local dataset directory or data file")
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        raise DataError(f"{name!r} is not a local path and the hub ({host}) cannot be reached",
                        hint="give a local dataset directory or data file (save_to_disk, JSONL, Parquet, Arrow)") from None
    return datasets.load_dataset(name, extra.get("name"), split=split, revision=extra.get("revision"), cache_dir=cache_dir)


# -- tokenizing -----------------------------------------------------------------------------------

@dataclass
class TokenizedDocs:
    """Every kept document as a token run: ``tokens[offsets[d]:offsets[d + 1]]``.

    ``mask[j]`` is 1 where token j is a training target (None: every token is).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None
    meta: dict[str, Any]

    @property
    def num_docs(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def chat_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Turn i spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
    ``render(messages[:i + 1])``: the assistant's content, its end-of-turn token and whatever separator
    the template puts after it, never the role header. Templates that re-render earlier turns
    differently (not prefix-stable) are rejected.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DataError("a chat sample must be a list of {role, content} messages")

    def render(msgs: list[dict], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs or gen else ""

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError("the tokenizer's chat template is not prefix-stable (an earlier turn renders differently "
                            "once later turns follow), so assistant turns cannot be located",
                            hint="use a template that renders each turn independently (e.g. ChatML)")
        spans.append((len(before), len(upto)))
    return full, spans


def _chat_batch(tokenizer: Any, conversations: list[Any]) -> list[tuple[list[int], list[int]]]:
    rendered = [chat_spans(tokenizer, c) if c else ("", []) for c in conversations]
    enc = tokenizer([r[0] for r in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for (_, spans), ids, offs in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
        mask = [int(any(s <= a < e for s, e in spans)) for a, _ in offs]
        out.append((list(ids), mask))
    return out


def tokenize_dataset(ds: Any, tokenizer: Any, *, text_key: str, chat: bool, messages_key: str, add_eos: bool,
                     add_special_tokens: bool) -> TokenizedDocs:
    if chat and not getattr(tokenizer, "is_fast", False):
        raise DataError("chat data needs a fast tokenizer (tokenizer.json) for token offsets")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template", hint="use a tokenizer with a chat_template, or text data")
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise DataError("the tokenizer has no eos token to end documents with", hint="set data.extra.add_eos=false")
    column = messages_key if chat else text_key
    chunks: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    dropped = 0
    for batch in ds.select_columns([column]).iter(batch_size=_TOKENIZE_BATCH):
        values = batch[column]
        if chat:
            docs = _chat_batch(tokenizer, values)
        else:
            texts = [v if isinstance(v, str) else "" for v in values]
            keep = [bool(t.strip()) for t in texts]
            enc = tokenizer([t for t, k in zip(texts, keep) if k] or [""], add_special_tokens=add_special_tokens)["input_ids"]
            it = iter(enc)
            docs = [(list(next(it)), None) if k else ([], None) for k in keep]
        for ids, mask in docs:
            if add_eos and ids:
                ids = ids + [eos]
                if mask is not None:
                    mask = mask + [0]  # the separator after a conversation is not trained
            # A document is empty if it has no token after the first that is a target.
            if len(ids) < 2 or (mask is not None and not any(mask[1:])):
                dropped += 1
                continue
            chunks.append(np.asarray(ids, dtype=np.int64))
            lengths.append(len(ids))
            if chat:
                masks.append(np.asarray(mask, dtype=np.uint8))
    if not chunks:
        raise DataError(f"no usable document in the data ({dropped} empty)",
                        hint="check data.text_key / the messages column and that chats have assistant turns")
    tokens = np.concatenate(chunks)
    dtype = np.uint16 if tokens.max() < 2**16 else np.int32
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    meta = {"documents": len(lengths), "dropped": dropped, "tokens": int(offsets[-1]), "max_token_id": int(tokens.max()),
            "chat": chat}
    return TokenizedDocs(tokens.astype(dtype), offsets, np.concatenate(masks) if chat else None, meta)


# -- the cache ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``: the first rank builds, the others wait. A failed builder releases it
    (the next one then builds and meets the same error), so no rank ever waits forever."""
    try:
        import fcntl

        f = open(path, "a+")
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: every rank builds, the rename keeps one result
            pass
        yield
    finally:
        f.close()


def _save(docs: TokenizedDocs, entry: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        np.save(tmp / "tokens.npy", docs.tokens)
        np.save(tmp / "offsets.npy", docs.offsets)
        if docs.mask is not None:
            np.save(tmp / "mask.npy", docs.mask)
        (tmp / "meta.json").write_text(json.dumps(docs.meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # lost a race to another node: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load(entry: Path) -> TokenizedDocs | None:
    if not (entry / "meta.json").is_file():
        return None
    meta = json.loads((entry / "meta.json").read_text())
    mask = np.load(entry / "mask.npy", mmap_mode="r") if (entry / "mask.npy").is_file() else None
    return TokenizedDocs(np.load(entry / "tokens.npy", mmap_mode="r"), np.load(entry / "offsets.npy"), mask, meta)


def tokenized_docs(options: dict[str, Any], ctx: DataContext) -> TokenizedDocs:
    """Tokenize (or load from the cache) the documents that ``options`` name."""
    extra = options.get("extra") or {}
    path = resolve_path(options.get("path"))
    tokenizer_path = options.get("tokenizer")
    files = _local_files(path) if path else None
    key = {
        "format_version": CACHE_FORMAT,
        "data": _files_fingerprint(files) if files else f"hub:{options.get('path')}:{extra.get('name')}:{extra.get('revision')}",
        "tokenizer": _tokenizer_fingerprint(tokenizer_path),
        **{k: options.get(k) for k in ("format", "split", "chat", "max_samples")},
        "text_key": options.get("text_key") or "text",
        "messages_key": extra.get("messages_key") or "messages",
        "add_eos": bool(extra.get("add_eos", True)),
        "add_special_tokens": bool(extra.get("add_special_tokens", False)),
    }
    fingerprint = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=12).hexdigest()
    root = options.get("cache_dir") or (os.path.join(ctx.run_dir, "data_cache") if ctx.run_dir else None)
    if root is None:
        with tempfile.TemporaryDirectory(prefix="hyperpar-data-") as tmp:
            return _build(options, tmp)
    root_path = Path(resolve_path(root))
    try:
        root_path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache {root} ({e.strerror})", hint="set a writable data.cache_dir") from None
    entry = root_path / f"tokens-{fingerprint}"
    docs = _load(entry)
    if docs is not None:
        return docs
    with _file_lock(root_path / f".tokens-{fingerprint}.lock"):
        docs = _load(entry)
        if docs is None:
            if files:  # datasets' Arrow copy of local files is only needed while tokenizing
                with tempfile.TemporaryDirectory(prefix=".hf_datasets-", dir=root_path) as tmp:
                    built = _build(options, tmp)
            else:  # keep a hub download
                built = _build(options, str(root_path / "hf_datasets"))
            built.meta["key"] = key
            _save(built, entry)
            log.info("data: tokenized %d documents (%d tokens, %d empty dropped) into %s",
                     built.meta["documents"], built.meta["tokens"], built.meta["dropped"], entry)
            docs = _load(entry)
    assert docs is not None
    return docs


def _build(options: dict[str, Any], datasets_cache: str) -> TokenizedDocs:
    try:
        return _build_docs(options, datasets_cache)
    except UnicodeDecodeError as e:
        # Arrow keeps invalid UTF-8 as is: it surfaces only when a string is read, while tokenizing.
        found = diagnose_json(_json_files(options))
        raise (found or DataError(f"{options.get('path')}: not UTF-8 text ({e.reason})")) from None


def _build_docs(options: dict[str, Any], datasets_cache: str) -> TokenizedDocs:
    extra = options.get("extra") or {}
    tokenizer = load_tokenizer(options.get("tokenizer"))
    ds = load_records(options, datasets_cache)
    text_key = options.get("text_key") or "text"
    messages_key = extra.get("messages_key") or "messages"
    chat = options.get("chat")
    columns = list(ds.column_names)
    if chat is None:
        chat = messages_key in columns and text_key not in columns
    column = messages_key if chat else text_key
    if column not in columns:
        what = "data.extra.messages_key" if chat else "data.text_key"
        raise DataError(f"the data has no column {column!r} (columns: {', '.join(columns)})", hint=f"set {what}")
    docs = tokenize_dataset(ds, tokenizer, text_key=text_key, chat=bool(chat), messages_key=messages_key,
                            add_eos=bool(extra.get("add_eos", True)), add_special_tokens=bool(extra.get("add_special_tokens", False)))
    docs.meta["pad_id"] = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    return docs


# -- samples --------------------------------------------------------------------------------------

class EpochOrder:
    """Global sample index -> unit index: epoch e = i // units visits ``perm_e``, a permutation seeded
    by (seed, e) (identity without shuffle)."""

    def __init__(self, units: int, seed: int, shuffle: bool) -> None:
        self.units = units
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 0x68797065]))
            self._perms[epoch] = rng.permutation(self.units)
        return self._perms[epoch]

    def __call__(self, index: int) -> int:
        epoch, j = divmod(index, self.units)
        return int(self.permutation(epoch)[j]) if self.shuffle else j


class TokenizedTextSource:
    """Packed blocks or padded documents of a :class:`TokenizedDocs`; ``num_samples`` samples in all."""

    def __init__(self, docs: TokenizedDocs, *, seq_len: int, num_samples: int, seed: int, pack: bool = True,
                 shuffle: bool = True, pad_id: int = 0) -> None:
        self.docs = docs
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.pack = pack
        self.pad_id = pad_id
        units = docs.num_tokens // (seq_len + 1) if pack else docs.num_docs
        if units == 0:
            raise DataError(f"the data has {docs.num_tokens} tokens, fewer than one packed sample of "
                            f"train.seq_len + 1 = {seq_len + 1}", hint="use less seq_len, more data or data.pack=false")
        self.units = units
        self.order = EpochOrder(units, seed, shuffle)

    @property
    def epochs(self) -> float:
        """How many passes over the data the run makes."""
        return self.num_samples / self.units

    def __len__(self) -> int:
        return self.num_samples

    def unit(self, index: int) -> int:
        """The block (pack) or document (no pack) that global sample ``index`` shows."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return self.order(index)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        u = self.unit(int(index))
        n = self.seq_len + 1
        if self.pack:
            a, b = u * n, (u + 1) * n
        else:
            a = int(self.docs.offsets[u])
            b = min(int(self.docs.offsets[u + 1]), a + n)
        block = np.full(n, self.pad_id, dtype=np.int64)
        block[: b - a] = self.docs.tokens[a:b]
        target = np.zeros(n, dtype=bool)
        target[1 : b - a] = True if self.docs.mask is None else self.docs.mask[a + 1 : b].astype(bool)
        labels = np.where(target[1:], block[1:], IGNORE_INDEX)
        out = {"input_ids": torch.from_numpy(block[:-1].copy()), "labels": torch.from_numpy(labels)}
        if self.pack:
            out["position_ids"] = torch.from_numpy(self._block_positions(a, n - 1))
        else:
            # The padding after a document is no token of it: the labels ignore it, and the mask keeps it
            # out of what else counts tokens (the MoE router statistics of the load-balancing loss).
            mask = np.zeros(n - 1, dtype=np.int64)
            mask[: b - a] = 1
            out["attention_mask"] = torch.from_numpy(mask)
        return out

    def _block_positions(self, a: int, length: int) -> np.ndarray:
        """Positions of stream tokens a … a+length−1, restarting at 0 where a document starts (and
        at the block start): the models keep packed documents apart by these restarts."""
        j = np.arange(a, a + length)
        offsets = self.docs.offsets
        start = offsets[np.searchsorted(offsets, j, side="right") - 1]
        return j - np.maximum(start, a)


def build_text_source(options: dict[str, Any], ctx: DataContext, *, default_format: str | None = None) -> TokenizedTextSource:
    if default_format and not options.get("format"):
        options = {**options, "format": default_format}
    docs = tokenized_docs(options, ctx)
    if docs.meta["max_token_id"] >= ctx.vocab_size:
        raise DataError(f"the tokenizer produced token id {docs.meta['max_token_id']} but the model's vocabulary has "
                        f"{ctx.vocab_size} ids", hint="use the model's own tokenizer (data.tokenizer) or a larger vocabulary")
    pad_id = int(docs.meta.get("pad_id", 0))
    if pad_id >= ctx.vocab_size:
        pad_id = 0  # padding is never a target and sits after every real token, so any id will do
    source = TokenizedTextSource(docs, seq_len=ctx.seq_len, num_samples=ctx.num_samples, seed=ctx.seed,
                                 pack=bool(options.get("pack", True)), shuffle=bool(options.get("shuffle", True)),
                                 pad_id=pad_id)
    log.info("data: %d documents, %d tokens -> %d %s; the run reads %d samples (%.2f epochs)",
             docs.num_docs, docs.num_tokens, source.units, "packed blocks" if source.pack else "documents",
             ctx.num_samples, source.epochs)
    return source


# What build_text_source reads (hf and json alike).
_TEXT_FIELDS = ("path", "tokenizer", "format", "split", "text_key", "pack", "shuffle", "chat", "max_samples", "cache_dir")
_TEXT_EXTRA = ("name", "revision", "messages_key", "add_eos", "add_special_tokens")


@register_dataset("hf", fields=_TEXT_FIELDS, extra=_TEXT_EXTRA)
def build_hf(options: dict, ctx: DataContext) -> TokenizedTextSource:
    return build_text_source(options, ctx)


@register_dataset("json", fields=_TEXT_FIELDS, extra=_TEXT_EXTRA)
def build_json(options: dict, ctx: DataContext) -> TokenizedTextSource:
    return build_text_source(options, ctx, default_format="json")
