"""Workers forked from a server that imported torch and hyperpar once (``launch.start_method=forkserver``).

A spawned worker imports torch, torch.distributed and the model code itself: ~2.5 s of one core
each. With more ranks than cores that import is most of a small run's start (eight ranks on two
cores: 20 s from the launch to the first worker line, 10 s with the server). The driver starts the
server as soon as it knows it will launch workers, so its imports overlap the driver's planning,
and every worker (restarts included) is a fork of it.

The server keeps the environment the driver had when it started it. A worker is handed the
driver's environment at launch with its arguments, and keeps on top of it only what the launcher
set for its rank (RANK, MASTER_PORT, ...), so it sees what a spawned worker would.
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = "hyperpar.fork_server_preload"
_server: tuple[int, dict[str, str]] | None = None  # (server pid, the environment it started with)


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def start() -> dict[str, str]:
    """Start the fork server with hyperpar's imports preloaded, unless it runs already; returns the
    environment it started with. Call it before anything else in this process uses forkserver."""
    global _server
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()
    pid = forkserver._forkserver._forkserver_pid  # a server that died is started again: new pid
    if _server is None or _server[0] != pid:
        _server = (pid, dict(os.environ))
    return _server[1]


def adopt_driver_env(driver_env: dict[str, str], server_env: dict[str, str]) -> None:
    """In a forked worker: the driver's environment at launch, plus what the launcher set here."""
    own = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(driver_env)
    os.environ.update(own)
