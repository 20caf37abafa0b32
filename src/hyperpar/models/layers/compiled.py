"""Plain functions compiled once per process: ``train.compile``'s kernels outside the compiled
blocks (the causal conv's forward and backward, the chunked delta rule, the cross-entropy's row
passes). One place keeps them, so each is compiled once however many layers call it, and a test can
see which ran or start again from nothing."""

from __future__ import annotations

from typing import Callable

import torch

_kernels: dict[tuple, Callable] = {}  # (fn, dynamic, options) -> compiled


def compile_once(fn: Callable, *, dynamic: bool | None = None, options: dict | None = None) -> Callable:
    """``torch.compile(fn, dynamic=dynamic, options=options)``, made once per process and setting.
    ``dynamic=None`` is torch.compile's default (the first shapes static, a second set of shapes
    recompiles once with them dynamic); ``False`` compiles each new shape once (for kernels that see
    one shape a run). ``options``: inductor settings for this function alone."""
    key = (fn, dynamic, tuple(sorted(options.items())) if options else None)
    if key not in _kernels:
        _kernels[key] = torch.compile(fn, dynamic=dynamic, options=options)
    return _kernels[key]


def compiled_names() -> set[str]:
    """Names of the functions compiled so far in this process."""
    return {key[0].__name__ for key in _kernels}


def clear() -> None:
    """Forget every compiled function (the next call compiles again; dynamo's own caches stay unless
    ``torch._dynamo.reset()`` is called too)."""
    _kernels.clear()
