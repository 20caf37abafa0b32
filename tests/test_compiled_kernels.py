"""The process-wide cache of compiled plain functions (``models/layers/compiled.py``)."""

from __future__ import annotations

import torch

from hyperpar.models.layers import compiled


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_each_function_and_setting_compiled_once():
    compiled.clear()
    f = compiled.compile_once(_double)
    assert compiled.compile_once(_double) is f  # every layer's call shares one compiled function
    assert compiled.compile_once(_double, dynamic=False) is not f  # another setting, another one
    assert compiled.compiled_names() == {"_double"}
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2)
    compiled.clear()
    assert compiled.compiled_names() == set() and compiled.compile_once(_double) is not f
