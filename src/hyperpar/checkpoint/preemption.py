"""Preemption (SIGTERM), Ctrl-C (SIGINT) and the test-only fault hooks.

SIGTERM and SIGINT only set a flag; the trainer all-reduces it after every step so all ranks stop
after the same step and save a checkpoint; the run then exits 0 (SIGTERM: preempted) or 130
(SIGINT: stopped by the user), printing how to resume. A second Ctrl-C exits at once, without saving
(the atomic save keeps the previous checkpoint the resume point). Repeats within
:data:`SIGINT_REPEAT_S` count as the same Ctrl-C: the terminal signals the whole process group and
the elastic agent forwards it once more. The elastic agent forwards a SIGTERM it receives to the
workers and kills them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (default 30): the current
step plus one save must fit in that time.

Test hooks (environment variables, read by the worker; never set them in production):

``HYPERPAR_TEST_SIGNAL_AT_STEP=<n>``
    After optimizer step ``n``, on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), the
    rank ``HYPERPAR_TEST_SIGNAL_RANK`` (default: 1 if there are several ranks, else 0) sends itself
    ``HYPERPAR_TEST_SIGNAL`` (``KILL``, the default, or ``TERM``). ``HYPERPAR_TEST_KILL_AT_STEP`` is
    an alias of ``..._SIGNAL_AT_STEP`` with ``KILL``.
``HYPERPAR_TEST_KILL_IN_SAVE=<n>``
    Every rank SIGKILLs itself in the save of step ``n`` after the data is written and before the
    checkpoint is published (first attempt only): a save killed halfway.
``HYPERPAR_TEST_DISK_FULL_AT_SAVE=<n>``
    The disk fills up during the save of step ``n``: every write of a DCP data file fails with ENOSPC
    after its first 4 KB (through DCP's own file-system layer), and the free space reads 4 KB.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("hyperpar")


SIGINT_REPEAT_S = 1.0
EXIT_SIGINT = 130


class PreemptionFlag:
    """Set by SIGTERM / SIGINT; ``install()`` is a no-op off the main thread (signal handlers live there)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT and time.monotonic() - self._first_at > SIGINT_REPEAT_S:
            print("[hyperpar] second Ctrl-C: exiting now without saving (the last complete checkpoint stays the "
                  "resume point)", file=sys.stderr, flush=True)
            os._exit(EXIT_SIGINT)
        if not self.requested:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            log.warning("received %s: stopping after this step and saving a checkpoint%s", what,
                        " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else "")
            self._first_at = time.monotonic()
            self.signum = signum
        self.requested = True

    @property
    def reason(self) -> str | None:
        """``preempted`` (SIGTERM), ``stopped`` (Ctrl-C), None when no signal came."""
        if self.signum is None:
            return None
        return "stopped" if self.signum == signal.SIGINT else "preempted"

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> "PreemptionFlag":
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous.clear()


def restart_attempt() -> int:
    """Which elastic attempt this process is (0: the first; a restarted worker group counts up)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def fault_hook_after_step(step: int, rank: int, world_size: int) -> None:
    """Test hook (see module doc): crash or preempt one rank after a given step, first attempt only."""
    at = os.environ.get("HYPERPAR_TEST_SIGNAL_AT_STEP") or os.environ.get("HYPERPAR_TEST_KILL_AT_STEP")
    if not at or int(at) != step or restart_attempt() != 0:
        return
    target = int(os.environ.get("HYPERPAR_TEST_SIGNAL_RANK", 1 if world_size > 1 else 0))
    if rank != target:
        return
    name = os.environ.get("HYPERPAR_TEST_SIGNAL", "KILL") if os.environ.get("HYPERPAR_TEST_SIGNAL_AT_STEP") else "KILL"
    sig = getattr(signal, f"SIG{name.upper().removeprefix('SIG')}")
    log.warning("test hook: rank %d sends itself %s after step %d", rank, sig.name, step)
    for h in logging.getLogger("hyperpar").handlers:
        h.flush()
    os.kill(os.getpid(), sig)


def fault_hook_in_save(step: int) -> None:
    """Test hook (see module doc): die between writing a checkpoint and publishing it."""
    at = os.environ.get("HYPERPAR_TEST_KILL_IN_SAVE")
    if at and int(at) == step and restart_attempt() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def fault_hook_disk_full(step: int) -> Iterator[None]:
    """Test hook (see module doc): DCP's data-file writes fail with ENOSPC during the save of ``step``."""
    at = os.environ.get("HYPERPAR_TEST_DISK_FULL_AT_SAVE")
    if not at or int(at) != step:
        yield
        return
    from torch.distributed.checkpoint import filesystem as fs

    original = fs.FileSystem.create_stream

    class _Full:
        def __init__(self, stream: Any, path: str) -> None:
            self._stream, self._path, self._written = stream, path, 0

        def write(self, data: Any) -> int:
            self._written += len(memoryview(data).cast("B"))
            if self._written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
            return self._stream.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._stream, name)

    @contextlib.contextmanager
    def full_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield _Full(stream, str(path)) if "w" in mode and str(path).endswith(".distcp") else stream

    import shutil

    usage = shutil.disk_usage

    def full_usage(path: Any) -> Any:
        return usage(path)._replace(free=4096)

    fs.FileSystem.create_stream, shutil.disk_usage = full_stream, full_usage
    try:
        yield
    finally:
        fs.FileSystem.create_stream, shutil.disk_usage = original, usage
