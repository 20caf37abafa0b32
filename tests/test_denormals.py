"""Flush-to-zero reaches every compute thread, including an OpenMP pool that existed before."""

import subprocess
import sys

_PROBE = r"""
import torch
torch.set_num_threads(2)
x = torch.full((4_000_000,), 1e-39)  # subnormal in fp32
assert int(((x * 1.0) != 0).sum()) == x.numel()  # IEEE: kept; this also starts the OpenMP pool
from hyperpar import denormals
if not denormals.flush_denormals(True):
    print("unsupported"); raise SystemExit
flushed = int(((x * 1.0) != 0).sum())  # every thread's share of the product
assert denormals.flushing()
denormals.flush_denormals(False)
assert not denormals.flushing()
kept = int(((x * 1.0) != 0).sum())
print(flushed, kept, x.numel())
"""


def test_flush_reaches_every_thread_and_is_undone() -> None:
    # A fresh process: the mode is per thread and must not leak into this test session.
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout.split()
    if out == ["unsupported"]:
        import pytest

        pytest.skip("this CPU cannot flush subnormals")
    flushed, kept, n = map(int, out)
    assert flushed == 0, f"{flushed} of {n} products stayed subnormal (a thread without FTZ/DAZ)"
    assert kept == n


def test_in_process_run_hands_the_callers_mode_back(tmp_path) -> None:
    """A run inside this process flushes while it trains and leaves IEEE floats behind it."""
    from helpers import PROBES, run_small

    from hyperpar import denormals

    assert not denormals.flushing()
    run_small(tmp_path, ["trainer._target_=helpers.ProbeTrainer"], steps=1)
    assert PROBES[str(tmp_path)]["flush_denormals"] is True
    assert not denormals.flushing()
