"""Preemption (SIGTERM) and the test-only fault hooks.

SIGTERM only sets a flag; the trainer all-reduces it after every step so all ranks stop after the
same step, save a checkpoint and exit 0. The elastic agent forwards a SIGTERM it receives to the
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
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger("hyperpar")


class PreemptionFlag:
    """Set by SIGTERM; ``install()`` is a no-op off the main thread (signal handlers live there)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.requested:
            log.warning("received %s: stopping after this step and saving a checkpoint", signal.Signals(signum).name)
        self.requested = True
        self.signum = signum

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> "PreemptionFlag":
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous.clear()


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def fault_hook_after_step(step: int, rank: int, world_size: int) -> None:
    """Test hook (see module doc): crash or preempt one rank after a given step, first attempt only."""
    at = os.environ.get("HYPERPAR_TEST_SIGNAL_AT_STEP") or os.environ.get("HYPERPAR_TEST_KILL_AT_STEP")
    if not at or int(at) != step or _attempt() != 0:
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
    if at and int(at) == step and _attempt() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
