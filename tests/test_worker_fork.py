"""Workers forked from the fork server see the driver's environment at launch, not the server's."""

from __future__ import annotations

import os

from hyperpar.worker_fork import adopt_driver_env


def test_forked_worker_takes_the_driver_env_and_keeps_its_rank_vars(monkeypatch):
    server = {"KEEP": "same", "STALE": "server-only", "CHANGED": "old"}
    # what a forked worker holds before its entry runs: the server's env plus the launcher's rank vars
    # (a stand-in mapping: adopt_driver_env rewrites the whole environment, the real one stays untouched)
    monkeypatch.setattr(os, "environ", {**server, "RANK": "3", "MASTER_PORT": "29500"})
    driver = {"KEEP": "same", "CHANGED": "new", "HYPERPAR_TEST_KILL_AT_STEP": "7"}
    adopt_driver_env(driver, server)
    assert os.environ == {"KEEP": "same", "CHANGED": "new", "HYPERPAR_TEST_KILL_AT_STEP": "7",
                          "RANK": "3", "MASTER_PORT": "29500"}
