"""On-disk cache of built indices: ``<H>-<Class>-<split>-<name>.npy`` plus a description file.

``H`` hashes everything the arrays depend on (for GPT indices that includes a content hash of the
corpus ``.idx``), so a rebuilt corpus or a changed setting can never pick up a stale index. Each
file is written to a temporary name and renamed into place; the description is renamed last and
marks the set complete, so concurrent builders (one per rank) and crashes are harmless.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any

import numpy as np

from hyperpar.errors import DataError

log = logging.getLogger(__name__)

_FINGERPRINTS: dict[tuple[str, int, int, int], str] = {}


def file_fingerprint(path: str) -> str:
    """blake2b of the file's bytes, memoised per (path, inode, size, mtime) within the process."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(16 << 20), b""):
                h.update(chunk)
        _FINGERPRINTS[key] = h.hexdigest()
    return _FINGERPRINTS[key]


def array_fingerprint(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).tobytes(), digest_size=16).hexdigest()


class IndexCache:
    """One cache entry: the arrays named in ``names`` for the description ``key``."""

    def __init__(self, directory: str | None, cls_name: str, split: str, key: dict[str, Any],
                 info: dict[str, Any] | None = None, explicit: bool = False) -> None:
        self.directory = directory
        self.explicit = explicit  # a user-given dir must work; the default dir may be read-only
        hashed = json.dumps(key, indent=4)
        self.description = json.dumps({**key, **(info or {})}, indent=4)
        self.hash = hashlib.md5(hashed.encode("utf-8"), usedforsecurity=False).hexdigest()
        self.stem = f"{self.hash}-{cls_name}-{split}"

    def path(self, name: str) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"{self.stem}-{name}")

    def load(self, names: list[str]) -> dict[str, np.ndarray] | None:
        """The cached arrays (memory-mapped), or None when any file is missing or unreadable."""
        if self.directory is None or not os.path.isfile(self.path("description.txt")):
            return None
        try:
            return {n: np.load(self.path(f"{n}.npy"), mmap_mode="r", allow_pickle=False) for n in names}
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable index cache %s: %s", self.stem, e)
            return None

    def save(self, arrays: dict[str, np.ndarray]) -> bool:
        """Write the arrays atomically; False (and a warning) when the default dir is not writable."""
        if self.directory is None:
            return False
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name, arr in arrays.items():
                self._atomic(f"{name}.npy", lambda f, a=arr: np.save(f, a, allow_pickle=False))
            self._atomic("description.txt", lambda f: f.write(self.description.encode("utf-8")))
            return True
        except OSError as e:
            if self.explicit:
                raise DataError(f"{self.directory}: cannot write the index cache ({e.strerror or e})",
                                hint="give a writable cache_dir") from None
            log.warning("index cache not written (%s); building in memory each run. "
                        "Pass a writable cache_dir to keep it.", e)
            return False

    def _atomic(self, name: str, write: Any) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.stem}-{name}.", dir=self.directory)
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, self.path(name))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
