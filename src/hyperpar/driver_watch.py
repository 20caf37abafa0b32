"""Workers started by our driver stop when the driver dies.

The driver runs PyTorch's elastic agent in-process; the workers are its children (``spawn``) or
children of the fork server (``forkserver``), and nothing in either makes them die with it. A driver
that is SIGKILLed (the OOM killer, ``kill -9``, a scheduler's hard kill) used to leave its workers
training on unsupervised, writing checkpoints and ``metrics.jsonl`` into a run dir whose lock the
kernel had released (so a resumed run could start beside them), and then waiting forever for an
agent to read their result, with the fork server and the resource tracker kept alive by them.

Each worker the driver starts watches the driver's pid (``HYPERPAR_DRIVER_PID``) from a daemon
thread (a pidfd where the kernel has one, else a poll every second). When the driver is gone the
worker treats it as a preemption: it sends itself SIGTERM, so the ranks stop after the same step and
save a checkpoint (``checkpoint.enabled``), then exits; whatever still runs ``grace_s`` seconds later
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30, as the agent itself would allow) exits at once.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hyperpar")

ENV = "HYPERPAR_DRIVER_PID"
_gone = threading.Event()


def gone() -> bool:
    """The driver this worker watches has died."""
    return _gone.is_set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_exit(pid: int, poll_s: float) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll
        while _alive(pid):
            time.sleep(poll_s)
        return
    try:
        poller = select.poll()  # not select(): no FD_SETSIZE limit on the descriptor's number
        poller.register(fd, select.POLLIN)
        while not poller.poll():  # readable once the process has exited
            pass
    finally:
        os.close(fd)


def watch(pid: int, on_gone: Callable[[], None], poll_s: float = 1.0) -> threading.Thread:
    """Call ``on_gone`` (in a daemon thread) once process ``pid`` has exited."""

    def run() -> None:
        _wait_for_exit(pid, poll_s)
        _gone.set()
        on_gone()

    thread = threading.Thread(target=run, name="hyperpar-driver-watch", daemon=True)
    thread.start()
    return thread


def grace_s() -> float:
    try:
        return max(1.0, float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)))
    except ValueError:
        return 30.0


def _stop_worker(pid: int) -> None:
    print(f"[hyperpar] the driver (pid {pid}) died: this worker stops after its step, saves a checkpoint when "
          f"checkpointing is on, and exits (at the latest in {grace_s():.0f} s)", file=sys.stderr, flush=True)
    log.warning("driver pid %d died: stopping as on SIGTERM", pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s())
    os._exit(1)


def watch_driver_from_env() -> threading.Thread | None:
    """In a worker started by our driver: stop (as on SIGTERM) when the driver dies."""
    value = os.environ.get(ENV)
    if not value:
        return None
    pid = int(value)
    return watch(pid, lambda: _stop_worker(pid))
