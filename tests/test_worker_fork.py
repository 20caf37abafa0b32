"""Workers forked from the fork server see the driver's environment at launch, not the server's."""

from __future__ import annotations

import os

from hyperpar.worker_fork import adopt_driver_env


def test_forked_worker_takes_the_driver_env_and_keeps_its_rank_vars(monkeypatch):
    server = {"KEEP": "same", "STALE": "server-only", "CHANGED": "old"}
    for k in list(os.environ):
        monkeypatch.delenv(k)
    # what a forked worker holds before its entry runs: the server's env plus the launcher's rank vars
    for k, v in {**server, "RANK": "3", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    driver = {"KEEP": "same", "CHANGED": "new", "HYPERPAR_TEST_KILL_AT_STEP": "7"}
    adopt_driver_env(driver, server)
    assert dict(os.environ) == {"KEEP": "same", "CHANGED": "new", "HYPERPAR_TEST_KILL_AT_STEP": "7",
                                "RANK": "3", "MASTER_PORT": "29500"}
