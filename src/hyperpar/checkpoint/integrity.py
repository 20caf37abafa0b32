"""Checksums of a checkpoint's files: recorded when a save completes, verified before resume and export.

A disk or a copy that flips bytes without changing a file's size passes every structural check and
loads as garbage (NaN weights, a "non-finite loss" much later). So the ``COMPLETE`` marker lists
every file of the checkpoint with its size and CRC-32 (zlib: ~0.3 ms per MB on one core, the cheapest
hash that catches such damage; this is about corruption, not tampering). Each rank hashes the files
it wrote, rank 0 the rest, so a save's hashing cost is that of one rank's shards.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hyperpar.errors import CheckpointError

log = logging.getLogger("hyperpar")

ALGORITHM = "crc32"
_CHUNK = 4 << 20
# Verified (or found damaged) in this process, keyed by every file's (name, size, mtime): rewriting a
# file forgets it. The driver hands its verified keys to the workers it spawns through the environment.
_verified: set[str] = set()
_damaged: dict[str, CheckpointError] = {}
_ENV = "HYPERPAR_VERIFIED_CHECKPOINTS"


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL: files hash in parallel threads
    return f"{crc:08x}"


def _hash_many(root: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    def one(rel: str) -> tuple[str, dict[str, Any]]:
        p = root / rel
        return rel, {"size": p.stat().st_size, ALGORITHM: file_crc32(p)}

    if len(rels) <= 1:
        return dict(map(one, rels))
    with ThreadPoolExecutor(max_workers=min(8, len(rels))) as pool:
        return dict(pool.map(one, rels))


def all_files(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in skip)


def rank_files(root: Path, rank: int) -> list[str]:
    """The files rank ``rank`` wrote itself: its DCP shards (``__<rank>_<i>.distcp``) and its RNG state."""
    own = [p.name for p in root.glob(f"__{rank}_*.distcp")]
    rng = root / "rng" / f"rank_{rank:05d}.json"
    return sorted(own) + ([str(rng.relative_to(root))] if rng.is_file() else [])


def checksum_files(root: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    return _hash_many(root, rels)


def complete_manifest(root: Path, partial: dict[str, dict[str, Any]], skip: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """(rank 0) The ranks' own checksums plus those of every other file of the checkpoint."""
    rest = [rel for rel in all_files(root, skip) if rel not in partial]
    return {**partial, **_hash_many(root, rest)}


def verify(ckpt: Path, marker: dict[str, Any], optional: tuple[str, ...] = ()) -> bool:
    """Raise one CheckpointError naming the first file that is missing, resized or altered; a file
    named in ``optional`` may be absent (a convenience copy), but not altered.

    Returns False (nothing checked) for a checkpoint saved before checksums were recorded.
    """
    files = marker.get("files")
    if not isinstance(files, dict):
        return False
    files = {rel: v for rel, v in files.items() if rel not in optional or (ckpt / rel).is_file()}
    for rel, want in sorted(files.items()):
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint '{ckpt}' is missing its file '{rel}'",
                                  hint="the checkpoint was copied incompletely; use an earlier checkpoint")
        size = p.stat().st_size
        if size != want.get("size"):
            how = "is truncated" if size < int(want.get("size") or 0) else "has changed size"
            raise CheckpointError(f"checkpoint file '{p}' {how}: {size} bytes, {want.get('size')} when it was saved",
                                  hint="the checkpoint was copied incompletely or the disk filled up; use an earlier checkpoint")
    key = _memo_key(ckpt, files)
    if key in _verified or key in os.environ.get(_ENV, "").split("\n"):
        return True
    if key in _damaged:
        raise _damaged[key]
    got = _hash_many(ckpt, sorted(files))
    for rel, want in sorted(files.items()):
        if got[rel][ALGORITHM] != want.get(ALGORITHM):
            _damaged[key] = CheckpointError(
                f"checkpoint file '{ckpt / rel}' is corrupt: its {ALGORITHM} checksum {got[rel][ALGORITHM]} "
                f"differs from {want.get(ALGORITHM)} recorded when it was saved",
                hint="the disk or a copy damaged it; use an earlier checkpoint")
            raise _damaged[key]
    _verified.add(key)
    return True


def _memo_key(ckpt: Path, files: dict[str, Any]) -> str:
    stats = []
    for rel in sorted(files):
        st = os.stat(ckpt / rel)
        stats.append((rel, st.st_size, st.st_mtime_ns))
    return json.dumps([str(ckpt.resolve()), stats])


def mark_verified(ckpt: Path, files: dict[str, Any]) -> None:
    """A checkpoint this process just wrote and hashed needs no second read."""
    _verified.add(_memo_key(ckpt, files))


def share_with_workers() -> None:
    """(driver) Spawned workers inherit the environment: they skip re-hashing what the driver verified."""
    os.environ[_ENV] = "\n".join(sorted(_verified))
