"""What the fork server imports before it forks workers (``worker_fork.PRELOAD``): every worker's
imports (``worker_imports``), and an exit that skips Python's finalization.

The server only ever leaves by ``SystemExit``, once the driver has gone. Finalizing a process that
holds torch's modules took ~0.85 s of a core (2 AMD cores), and the server holds the driver's stdout
and stderr open until it has ended, so whoever reads a run's output to its end (a test, a pipe, a
scheduler's log collector) waited that long after every multi-process run. The workers it forks
never run this handler: a forked child of the server always ends with ``os._exit``.
"""

import atexit
import os

import hyperpar.worker_imports  # noqa: F401


def _exit_at_once() -> None:
    os._exit(0)  # nothing left to flush: the server writes nothing


atexit.register(_exit_at_once)  # registered last, so it runs first
