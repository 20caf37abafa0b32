"""The host CPU's ``/proc/cpuinfo`` fields (vendor, flags, model name), read once per process.

The CPU GEMM policies pick their kernels by vendor and instruction set (``launch.cpu_gemm``,
``train.mixed_precision.cpu_matmul``), and the bench prints them; all read the file here."""

from __future__ import annotations

import functools


@functools.cache
def _fields() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: nothing known
        pass
    return fields


def field(name: str) -> str:
    """The first processor's ``name`` field of ``/proc/cpuinfo`` ("" where unknown)."""
    return _fields().get(name, "")
