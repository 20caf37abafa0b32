"""An exclusive lock on a run directory: two runs writing one dir corrupt both.

Two invocations with the same ``hydra.run.dir`` would interleave ``metrics.jsonl``, publish each
other's half-written checkpoints and mix configs and results. The driver takes ``<run_dir>/.hyperpar.lock``
(``fcntl.flock``: the kernel drops it when the process dies, so a crashed run leaves no stale lock)
before anything is written; the file records who holds it, for the message the second run prints.
Where ``flock`` is not supported (some network filesystems) the file itself is the lock, and one
left by a dead process on this host is detected and taken over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hyperpar.errors import ConfigError

LOCK_FILE = ".hyperpar.lock"
_held: dict[str, tuple[int, int, bool]] = {}  # resolved run dir -> (fd, depth, file-lock fallback) of this process


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    return f"pid {info.get('pid')} on {info.get('host')} (since {info.get('since')})"


def _alive(info: dict[str, Any]) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # cannot tell: assume it is
    try:
        os.kill(int(info.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


def _busy(run_dir: Path, lock: Path) -> ConfigError:
    return ConfigError(f"run dir '{run_dir}' is in use by another hyperpar run: {_describe(lock)}",
                       hint="wait for it to finish, or give this run its own hydra.run.dir")


def ensure_run_dir(run_dir: str | Path) -> Path:
    """Create the run dir; an uncreatable or read-only one is one ConfigError naming it."""
    p = Path(run_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run dir '{run_dir}': {e.strerror}",
                          hint="set hydra.run.dir to a writable directory") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"the run dir '{run_dir}' is not writable", hint="set hydra.run.dir to a writable directory")
    return p


def _take_file_lock(run_dir: Path, lock: Path) -> int:
    """Fallback without flock: create the file exclusively; take over one of a dead process."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            try:
                info = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                info = {}
            if not info or not _alive(info):
                lock.unlink(missing_ok=True)  # stale: released under flock, or its process is gone
                continue
            raise _busy(run_dir, lock) from None
        return fd
    raise _busy(run_dir, lock)


def acquire(run_dir: str | Path) -> None:
    """Take the lock (re-entrant within this process); ConfigError when another process holds it."""
    import fcntl

    p = ensure_run_dir(run_dir)
    key = str(p.resolve())
    if key in _held:
        fd, depth, fallback = _held[key]
        _held[key] = (fd, depth + 1, fallback)
        return
    lock = p / LOCK_FILE
    fallback = False
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(p, lock) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        fd, fallback = _take_file_lock(p, lock), True
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(_owner()) + "\n").encode())
    _held[key] = (fd, 1, fallback)


def release(run_dir: str | Path) -> None:
    key = str(Path(run_dir).resolve())
    if key not in _held:
        return
    fd, depth, fallback = _held[key]
    if depth > 1:
        _held[key] = (fd, depth - 1, fallback)
        return
    del _held[key]
    with contextlib.suppress(OSError):
        if fallback:
            os.unlink(Path(key) / LOCK_FILE)
        else:
            os.ftruncate(fd, 0)
    os.close(fd)  # drops the flock; an empty file stays, harmless


@contextlib.contextmanager
def hold(run_dir: str | Path) -> Iterator[None]:
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)
