"""Megatron-LM indexed corpora: the ``P.bin`` / ``P.idx`` pair, read zero-copy and written byte-exact.

``P.bin`` holds the token ids of every sequence back to back; ``P.idx`` is a 34-byte header
(magic, version, dtype code, sequence count S, document-index length D) followed by
``int32 lengths[S]``, ``int64 byte pointers[S]``, ``int64 document_indices[D]`` and, for multimodal
corpora only, ``int8 modes[S]``. Everything is little-endian. Names follow megatron-core so user
code moves over unchanged.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperpar.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes, no padding
HEADER_SIZE = _HEADER.size
_CHUNK = 1 << 22

# Codes 6 and 7 are float64 / float32 as in current megatron-core (7 was float64 before mid-2023).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def dtype_code(dtype: Any) -> int:
    """The header byte for ``dtype``; a DataError for dtypes the format cannot store."""
    dt = np.dtype(dtype).newbyteorder("=")
    if dt not in _CODE_OF:
        raise DataError(f"dtype {dt} cannot be stored in a Megatron .bin file",
                        hint="use uint16 (vocab < 65500) or int32")
    return _CODE_OF[dt]


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """megatron-core's writer rule: uint16 only below 65500 (not 65536), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


class IndexedDataset:
    """Random access to the sequences of one Megatron corpus; ``len()`` is the sequence count.

    ``multimodal=None`` detects the optional modes array from the file size (the header has no
    flag for it); ``True``/``False`` insist on one layout.
    """

    def __init__(self, path_prefix: str, multimodal: bool | None = None, mmap: bool = True) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self._requested_multimodal = multimodal
        self._mmap = mmap  # kept for megatron-core signature compatibility; reads are always mmapped
        self._open()

    # -- opening and validation ---------------------------------------------------------------

    def _open(self) -> None:
        idx_path, bin_path = get_idx_path(self.path_prefix), get_bin_path(self.path_prefix)
        if not os.path.isfile(idx_path):
            raise DataError(f"{idx_path}: index file not found",
                            hint="a Megatron corpus is given by its prefix, without .bin/.idx")
        if not os.path.isfile(bin_path):
            raise DataError(f"{bin_path}: token file not found (its .idx exists)")

        idx = _map_file(idx_path)
        s, d, code = self._parse_header(idx, idx_path)
        self.dtype = DTYPE_CODES[code]
        self.multimodal = self._layout(len(idx), s, d, idx_path)

        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=s, offset=off)
        off += 4 * s
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=s, offset=off)
        off += 8 * s
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=d, offset=off)
        off += 8 * d
        self.sequence_modes = np.frombuffer(idx, dtype="<i1", count=s, offset=off) if self.multimodal else None

        bin_size = os.path.getsize(bin_path)
        self._validate_arrays(s, bin_size, idx_path, bin_path)
        # One flat token view over the whole .bin: a sequence is then a plain slice (no copy).
        self.tokens = np.frombuffer(_map_file(bin_path), dtype=self.dtype.newbyteorder("<"),
                                     count=bin_size // self.dtype.itemsize)

    @staticmethod
    def _parse_header(idx: Any, idx_path: str) -> tuple[int, int, int]:
        if len(idx) < HEADER_SIZE:
            raise DataError(f"{idx_path}: truncated header ({len(idx)} of {HEADER_SIZE} bytes)")
        magic, version, code, s, d = _HEADER.unpack_from(idx, 0)
        if magic != _MAGIC:
            raise DataError(f"{idx_path}: bad magic {magic!r}, not a Megatron MMIDIDX index",
                            hint="the legacy TNTIDX format is not supported")
        if version != _VERSION:
            raise DataError(f"{idx_path}: unsupported index version {version} (expected 1)")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown dtype code {code}")
        if d < 1:
            raise DataError(f"{idx_path}: document index is empty (must start with 0)")
        return s, d, code

    def _layout(self, size: int, s: int, d: int, idx_path: str) -> bool:
        plain = HEADER_SIZE + 12 * s + 8 * d
        if size < plain:
            raise DataError(f"{idx_path}: truncated ({size} bytes, header promises {plain} for "
                            f"{s} sequences and {d - 1} documents)")
        want = self._requested_multimodal
        if size == plain and want is not True:
            return False
        if size == plain + s and want is not False:
            return True
        if size == plain and want:
            raise DataError(f"{idx_path}: truncated (no sequence modes, but multimodal=True)")
        if size == plain + s:
            raise DataError(f"{idx_path}: holds sequence modes (a multimodal corpus), but multimodal=False")
        raise DataError(f"{idx_path}: {size - plain} unexpected trailing bytes after the index arrays")

    def _validate_arrays(self, s: int, bin_size: int, idx_path: str, bin_path: str) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if docs[0] != 0 or docs[-1] != s:
            raise DataError(f"{idx_path}: document indices must run from 0 to the sequence count "
                            f"{s}, found {int(docs[0])}..{int(docs[-1])}")
        itemsize = self.dtype.itemsize
        # In chunks, so opening a 100M-sequence corpus does not allocate gigabytes of temporaries.
        for a in range(0, len(docs) - 1, _CHUNK):
            part = docs[a:a + _CHUNK + 1]
            if bool(np.any(part[1:] < part[:-1])):
                raise DataError(f"{idx_path}: document indices are not non-decreasing")
        for a in range(0, s, _CHUNK):
            lens, ptrs = lengths[a:a + _CHUNK], pointers[a:a + _CHUNK]
            if int(lens.min()) < 0:
                raise DataError(f"{idx_path}: negative sequence length")
            if int(ptrs.min()) < 0 or bool(np.any(ptrs % itemsize)):
                raise DataError(f"{idx_path}: sequence pointers not aligned to {itemsize}-byte tokens")
            ends = ptrs + lens.astype(np.int64) * itemsize
            if int(ends.max()) > bin_size:
                bad = a + int(np.argmax(ends > bin_size))
                raise DataError(f"{idx_path}: sequence {bad} points past the end of {bin_path} "
                                f"(needs {int(ends.max())} bytes, file has {bin_size})")

    # -- reading -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int | np.integer, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` as a read-only view of the .bin."""
        n = len(self)
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for a sequence of {size}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    @property
    def document_count(self) -> int:
        return len(self.document_indices) - 1

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))

    # DataLoader workers get the path, not a pickled copy of the mapped corpus.
    def __getstate__(self) -> dict[str, Any]:
        return {"path_prefix": self.path_prefix, "multimodal": self._requested_multimodal, "mmap": self._mmap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path_prefix"], state["multimodal"], state["mmap"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
                f"documents={self.document_count}, dtype={self.dtype})")


def _map_file(path: str) -> Any:
    """A read-only mapping of ``path`` (an empty bytes object for an empty file: mmap refuses those)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDatasetBuilder:
    """Streams sequences into ``bin_path``; ``finalize(idx_path)`` writes the index."""

    def __init__(self, bin_path: str, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.multimodal = multimodal
        self.bin_path = os.fspath(bin_path)
        # Written under a temporary name and renamed by finalize(): a process still mapping the old
        # corpus keeps its file instead of faulting on a truncated one.
        self._tmp_bin = f"{self.bin_path}.tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        # array.array keeps a 100M-sequence corpus at 4 + 8 bytes per entry instead of Python ints.
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self.sequence_modes = array("b") if multimodal else None

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.bin_path}: a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype != self.dtype and self.dtype.kind in "iu":
            if arr.dtype.kind not in "iub":
                raise DataError(f"{self.bin_path}: token ids must be integers, got {arr.dtype}")
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            # megatron-core wraps silently (70000 -> 4464 in uint16); a corrupt corpus is worse.
            if lo < info.min or hi > info.max:
                raise DataError(f"{self.bin_path}: token id {hi if hi > info.max else lo} does not "
                                f"fit the corpus dtype {self.dtype}", hint="write the corpus as int32")
        if arr.size >= 2**31:
            raise DataError(f"{self.bin_path}: a sequence of {arr.size} tokens exceeds the int32 length field")
        return np.ascontiguousarray(arr, dtype=self.dtype.newbyteorder("<"))

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (it belongs to the document closed by the next ``end_document``)."""
        arr = self._as_tokens(tokens)
        self._bin.write(arr.tobytes())
        self.sequence_lengths.append(arr.size)
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(self, tokens: Any, lengths: Sequence[int], modes: Sequence[int] | None = None) -> None:
        """Append a document made of ``len(lengths)`` sequences cut from ``tokens``, and close it."""
        arr = self._as_tokens(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != arr.size or any(n < 0 for n in lengths):
            raise DataError(f"{self.bin_path}: sequence lengths {lengths} do not cut {arr.size} tokens")
        self._bin.write(arr.tobytes())
        self.sequence_lengths.extend(lengths)
        if self.sequence_modes is not None:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))
        self.end_document()

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another corpus of the same dtype.

        As in megatron-core, sequences added since the last ``end_document()`` become part of the
        merged corpus's first document.
        """
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise DataError(f"{get_idx_path(path_prefix)}: dtype {other.dtype} cannot be merged into "
                            f"a {self.dtype} corpus ({self.bin_path})")
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(other.sequence_lengths.astype("<i4").tobytes())
        shifted = other.document_indices[1:].astype(np.int64) + base
        self.document_indices.frombytes(shifted.astype("<i8").tobytes())
        if self.sequence_modes is not None and other.sequence_modes is not None:
            self.sequence_modes.frombytes(other.sequence_modes.tobytes())
        self._bin.flush()
        with open(get_bin_path(path_prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)

    def abort(self) -> None:
        """A failed build: close and remove the temporary .bin (no ``*.bin.tmp<pid>`` left behind)."""
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.unlink(self._tmp_bin)

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx (to a temporary name first, so no half index is ever seen)."""
        self._bin.close()
        s = len(self.sequence_lengths)
        if self.document_indices[-1] != s:
            open_count = s - self.document_indices[-1]
            os.unlink(self._tmp_bin)
            raise DataError(f"{self.bin_path}: {open_count} sequence(s) added after the last "
                            "end_document()", hint="close every document before finalize()")
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(s, dtype=np.int64)
        if s > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        os.replace(self._tmp_bin, self.bin_path)
        docs = np.frombuffer(self.document_indices, dtype=np.int64)
        tmp = f"{idx_path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, s, len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
            if self.sequence_modes is not None:
                f.write(self.sequence_modes.tobytes())
        os.replace(tmp, idx_path)
