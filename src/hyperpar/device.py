"""cpu / cuda / npu behind one small interface: device, backend, RNG and memory statistics.

torch_npu is imported only when the NPU is asked for or detected, so CPU and GPU users never need it.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from hyperpar.errors import ConfigError


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # cpu | cuda | npu
    backend: str  # gloo | nccl | hccl

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type, local_rank)

    @property
    def module(self):
        return getattr(torch, self.type) if self.type != "cpu" else None

    def set_device(self, local_rank: int) -> None:
        if self.type != "cpu":
            self.module.set_device(local_rank)

    def synchronize(self) -> None:
        if self.type != "cpu":
            self.module.synchronize()

    def reset_peak_memory(self) -> None:
        if self.type != "cpu":
            self.module.reset_peak_memory_stats()
        else:
            _cpu_peak.reset()

    def peak_memory_mb(self) -> float:
        if self.type != "cpu":
            return self.module.max_memory_allocated() / 2**20
        return _cpu_peak.peak_mb()

    def memory_capacity_mb(self) -> float | None:
        if self.type != "cpu":
            return self.module.get_device_properties(0).total_memory / 2**20
        return None

    def seed_all(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds cuda / npu generators

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak dense matmul FLOP/s for MFU; overridable with HYPERPAR_PEAK_TFLOPS."""
        env = os.environ.get("HYPERPAR_PEAK_TFLOPS")
        if env:
            return float(env) * 1e12
        if self.type == "cuda":
            name = torch.cuda.get_device_name(0)
            for key, tflops in (("H200", 989), ("H100", 989), ("A100", 312), ("L40", 181)):
                if key in name:
                    return (tflops if dtype != torch.float32 else tflops / 2 if key != "A100" else 19.5) * 1e12
            return 100e12
        if self.type == "npu":
            return 313e12 if dtype != torch.float32 else 78e12
        # CPU: measured on the reference 2-core machine (PERF_NOTES): ~215 fp32 / ~910 bf16 GFLOP/s.
        return 910e9 if dtype == torch.bfloat16 else 215e9


class _CpuPeak:
    """Peak resident set size of this process; CPU has no allocator statistics like CUDA's."""

    def __init__(self) -> None:
        self._base = 0.0

    def reset(self) -> None:
        self._base = 0.0

    def peak_mb(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_cpu_peak = _CpuPeak()


def resolve_device(name: str = "auto") -> DeviceInfo:
    if name == "auto":
        if torch.cuda.is_available():
            return DeviceInfo("cuda", "nccl")
        if _npu_available():
            return DeviceInfo("npu", "hccl")
        return DeviceInfo("cpu", "gloo")
    if name == "cpu":
        return DeviceInfo("cpu", "gloo")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible", hint="use device=auto or device=cpu")
        return DeviceInfo("cuda", "nccl")
    if name == "npu":
        if not _npu_available():
            raise ConfigError("device=npu but torch_npu is missing or sees no NPU", hint="pip install 'hyperpar[npu]'")
        return DeviceInfo("npu", "hccl")
    raise ConfigError(f"unknown device '{name}'", hint="use auto, cpu, cuda or npu")
