"""Session-wide test settings. Tiny configs live in fixtures.py, shared functions in helpers.py
(both importable because pytest puts this directory on sys.path for the conftest)."""

from __future__ import annotations

import os

import pytest
import torch

# The machine runs several suites at once: one intra-op thread keeps in-process tests from
# oversubscribing the cores, and subprocess runs set their own (launch.threads_per_rank).
torch.set_num_threads(1)
os.environ.setdefault("HYPERPAR_NO_BAR", "1")


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """Factory: ``tiny_hf_dir(config) -> Path`` writes a config.json-only HF directory (geometry, no weights)."""
    import json

    def make(config: dict, name: str = "hf"):
        d = tmp_path / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        return d

    return make


@pytest.fixture
def hyperpar_log():
    """What the ``hyperpar`` logger said during the test (it does not propagate to pytest's caplog)."""
    import logging

    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = _Keep(level=logging.INFO)
    logger = logging.getLogger("hyperpar")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
