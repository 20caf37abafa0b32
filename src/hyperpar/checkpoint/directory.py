"""The on-disk layout of a run's checkpoints, and the rules that make a save atomic.

```
<run_dir>/checkpoints/
  step_<n>.tmp/      being written (never resumed from)
  step_<n>/          complete: renamed from .tmp by rank 0 after every rank finished; holds COMPLETE
  latest             text file naming the newest published step dir (replaced atomically)
```

A directory counts as a checkpoint only if its name is ``step_<n>`` *and* it holds the ``COMPLETE``
marker, which rank 0 writes inside the ``.tmp`` directory before the rename. A run killed at any
point of a save leaves at most a ``.tmp`` directory, which resume ignores. The marker lists every
file with its size and checksum (``integrity``); a checkpoint is *verified* once they match.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hyperpar.checkpoint import integrity
from hyperpar.errors import CheckpointError

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
CONFIG = "config.yaml"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
ABANDONED = "abandoned"

_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step_{step}"


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / MARKER).is_file()


def list_complete(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (a checkpoints dir), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = step_of(p)
        if step is not None and p.is_dir() and (p / MARKER).is_file():
            found.append((step, p))
    return sorted(found)


def incomplete(root: str | Path) -> list[Path]:
    """Leftovers of interrupted saves (``step_<n>.tmp``, or a ``step_<n>`` without its marker)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not is_complete(p)
                  and not p.name.endswith(".deleting"))


def newest_complete(root: str | Path) -> Path | None:
    found = list_complete(root)
    return found[-1][1] if found else None


def resolve_load_path(path: str | Path, what: str = "checkpoint.load_path",
                      pick: Callable[[Path], Path | None] | None = None) -> Path:
    """A ``step_<n>`` directory, or a checkpoints / run directory: the checkpoint ``pick(root)`` chooses
    there (default: its newest complete one)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{what} '{path}' does not exist",
                              hint="give a checkpoints/step_<n> directory or a run directory that has checkpoints")
    if p.is_file() and p.name == LATEST:  # checkpoints/latest names the newest published checkpoint
        p = p.parent / p.read_text().strip()
        if not p.is_dir():
            raise CheckpointError(f"{what} '{path}' names '{p.name}', which is not there")
    if not p.is_dir():
        raise CheckpointError(f"{what} '{path}' is not a directory",
                              hint="give a checkpoints/step_<n> directory")
    if (p / DCP_METADATA).exists() or step_of(p) is not None or p.name.endswith(".tmp"):
        if not (p / MARKER).is_file():
            raise CheckpointError(f"checkpoint '{p}' is incomplete (no {MARKER} marker: its save was interrupted)",
                                  hint="use an earlier complete checkpoint, or resume=auto to pick the newest complete one")
        return p
    for root in (p, p / CHECKPOINTS):
        if list_complete(root):
            chosen = (pick or newest_complete)(root)
            if chosen is not None:
                return chosen
    raise CheckpointError(f"'{path}' holds no complete checkpoint", hint="give a checkpoints/step_<n> directory")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file '{path}' is corrupt or truncated ({what}: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint file '{path}' is not a JSON object ({what})")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write and fsync: the marker of a save must never be visible before what it vouches for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


def prepare_tmp(root: Path, step: int) -> Path:
    """(rank 0) A fresh ``step_<n>.tmp``; a leftover of an earlier, interrupted save of this step is removed."""
    tmp = root / f"{step_name(step)}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def retire_newer(root: Path, kept: Path) -> list[Path]:
    """Move the complete checkpoints of ``root`` newer than ``kept`` (one of ``root``'s, which a run
    rewinds to) into ``root/abandoned/<time>/``: they belong to the branch the run leaves, so neither
    ``resume=auto`` nor a restart may return to them; they stay on disk for whoever wants them back.
    ``latest`` then names ``kept``. Returns where they went."""
    step = step_of(kept)
    newer = [p for s, p in list_complete(root) if step is not None and s > step]
    if not newer:
        return []
    dest = root / ABANDONED / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in newer:
        os.rename(p, dest / p.name)
        moved.append(dest / p.name)
    _write_latest(root, kept.name)
    return moved


def _write_latest(root: Path, name: str) -> None:
    """``root/latest`` names ``name``: written aside, synced, and renamed over (never half a name)."""
    latest_tmp = root / f"{LATEST}.tmp"
    with open(latest_tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def publish(tmp: Path, step: int, marker: dict[str, Any]) -> Path:
    """(rank 0, after a barrier) Marker, rename, ``latest``: the checkpoint becomes visible in one rename.

    ``marker["files"]`` is the checksum manifest of the directory's files (``integrity``).
    """
    _fsync_tree(tmp)
    write_json(tmp / MARKER, {**marker, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    final = tmp.parent / step_name(step)
    if final.exists():
        # Re-saving a step (a run resumed from an earlier checkpoint into the same dir): retire the old one
        # first; a crash in between leaves the .tmp (complete but unpublished) and older checkpoints.
        retired = final.with_name(final.name + ".deleting")
        if retired.exists():
            shutil.rmtree(retired)
        os.rename(final, retired)
        shutil.rmtree(retired, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(tmp.parent)
    _write_latest(tmp.parent, final.name)
    return final


def read_marker(ckpt: Path) -> dict[str, Any]:
    return read_json(ckpt / MARKER, "completion marker")


def verify_checkpoint(ckpt: Path) -> bool:
    """Every file the marker lists is there, of its size and checksum (one CheckpointError naming the
    first that is not). False: a checkpoint saved without checksums, nothing to compare."""
    # config.yaml is a copy for export (``--config`` replaces it): it may be gone, not changed.
    return integrity.verify(ckpt, read_marker(ckpt), optional=(CONFIG,))


def prune(root: Path, keep_last: int, *, trusted: set[Path] | None = None) -> list[Path]:
    """(rank 0) Keep the newest ``keep_last`` *trusted* checkpoints (written or verified by this run;
    default: all) and delete the complete ones older than them; never incomplete ones, never an untrusted newer one.

    So a run that fell back to an older checkpoint past a damaged newer one never deletes its good
    resume point while keeping the damaged one. A checkpoint is first renamed out of the ``step_<n>``
    namespace, so a crash mid-delete never leaves a half-deleted directory that resume would take.
    """
    if keep_last <= 0:
        return []
    found = list_complete(root)
    ok = {p.resolve() for p in trusted} if trusted is not None else {p.resolve() for _, p in found}
    good = [s for s, p in found if p.resolve() in ok]
    if len(good) < keep_last:
        return []
    oldest_kept = good[-keep_last]
    doomed = [p for s, p in found if s < oldest_kept]
    for p in doomed:
        retired = p.with_name(p.name + ".deleting")
        os.rename(p, retired)
        shutil.rmtree(retired, ignore_errors=True)
    return doomed
