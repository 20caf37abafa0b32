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


# Dense (no sparsity) TFLOP/s from NVIDIA's datasheets: (name contains, bf16/fp16, TF32, FP32). More
# specific names first ("H100 PCIe" before "H100", "L40S" before "L40").
_CUDA_PEAK_TFLOPS = (
    ("H200", 989, 494, 67), ("H100 PCIe", 756, 378, 51), ("H100", 989, 494, 67),
    ("A100", 312, 156, 19.5), ("L40S", 362, 183, 91.6), ("L40", 181, 90.5, 90.5),
)


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
        """Start a new peak-memory window (the trainer calls it at the start of every step); on CPU also
        the window of :meth:`page_faults`."""
        if self.type != "cpu":
            self.module.reset_peak_memory_stats()
        else:
            _cpu_peak.reset()

    def peak_memory_mb(self) -> float | None:
        """Peak memory since :meth:`reset_peak_memory`: the allocator's high-water mark on GPU/NPU; on CPU
        the process's peak resident set size (VmHWM) over the window, None where Linux cannot reset it."""
        if self.type != "cpu":
            return self.module.max_memory_allocated() / 2**20
        return _cpu_peak.peak_mb()

    def page_faults(self) -> int | None:
        """On CPU: the page faults this process took since :meth:`reset_peak_memory`, every thread's
        (``getrusage``: minor and major). A step that reuses warm memory takes few; memory handed back
        to the OS and allocated again is faulted in page by page (see ``launch.host_allocator``).
        None on an accelerator."""
        return _cpu_peak.faults() if self.type == "cpu" else None

    def check_local_processes(self, n: int) -> None:
        """One rank per accelerator: ``n`` processes on this node need ``n`` visible devices (a second rank
        on a device would fail deep in NCCL/HCCL, or in set_device, with no word of the layout)."""
        if self.type == "cpu":
            return
        have = self.module.device_count()
        if n > have:
            raise ConfigError(f"the layout starts {n} processes on this node, one per {self.type} device, but "
                              f"{have} {self.type} device{'s are' if have != 1 else ' is'} visible",
                              hint=f"pick a layout of at most {have} process{'es' if have != 1 else ''} per node, "
                                   "or device=cpu (gloo runs any layout)")

    def memory_capacity_mb(self) -> float | None:
        if self.type != "cpu":
            return self.module.get_device_properties(0).total_memory / 2**20
        return None

    def seed_all(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds cuda / npu generators

    def peak_flops(self, dtype: torch.dtype, tflops: float | None = None) -> float | None:
        """Peak dense matmul FLOP/s of one device for MFU: ``tflops`` (metrics.peak_tflops) when set, else
        the datasheet figure of a known accelerator, else None (MFU is then reported as null)."""
        if tflops is not None:
            if tflops <= 0:
                raise ConfigError(f"metrics.peak_tflops={tflops} must be > 0", hint="the device's peak dense TFLOP/s, or null")
            return float(tflops) * 1e12
        fp32 = dtype == torch.float32
        if self.type == "cuda":
            name = torch.cuda.get_device_name(0)
            # fp32 matmuls run on tensor cores (TF32) only when float32_matmul_precision allows it.
            tf32 = torch.get_float32_matmul_precision() != "highest"
            for key, half, tf32_peak, fp32_peak in _CUDA_PEAK_TFLOPS:
                if key in name:
                    return (half if not fp32 else tf32_peak if tf32 else fp32_peak) * 1e12
            return None
        if self.type == "npu":
            return (78 if fp32 else 313) * 1e12  # Ascend 910B datasheet
        return None  # a CPU's peak depends on its cores, vector units and clocks: set metrics.peak_tflops


class _CpuPeak:
    """Per-step peak RSS on Linux: writing "5" to /proc/self/clear_refs resets the kernel's high-water
    mark (VmHWM) to the current RSS, so VmHWM read later is the peak since the reset. CPU tensors have
    no allocator statistics like CUDA's; RSS also counts the interpreter and libraries (a few hundred MB).
    The same window counts the process's page faults."""

    def __init__(self) -> None:
        self._window = False  # a reset succeeded, so VmHWM describes the current window
        self._faults: int | None = None  # the process's page faults at the reset

    def reset(self) -> None:
        self._faults = _faults_now()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._window = True
        except OSError:  # not Linux, or a kernel/container that forbids it: no per-step figure
            self._window = False

    def peak_mb(self) -> float | None:
        if not self._window:
            return None
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0  # kB
        except OSError:
            pass
        return None

    def faults(self) -> int | None:
        now = _faults_now()
        return None if now is None or self._faults is None else now - self._faults


def _faults_now() -> int | None:
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    r = resource.getrusage(resource.RUSAGE_SELF)
    return int(r.ru_minflt + r.ru_majflt)


_cpu_peak = _CpuPeak()


def set_deterministic(enabled: bool, fill_uninitialized_memory: bool = False) -> bool:
    """train.deterministic: deterministic kernels where PyTorch has them (a warning names an op that has
    none), cuBLAS's fixed workspace, no cuDNN autotuning; with ``fill_uninitialized_memory``
    (train.fill_uninitialized_memory) also PyTorch's NaN fill of every new tensor. CUBLAS_WORKSPACE_CONFIG
    must be set before the first cuBLAS call, so the worker calls this before it builds anything on the
    device. Returns the fill setting it replaced (an in-process caller's, handed back at the end)."""
    from torch.utils import deterministic

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    before = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = bool(fill_uninitialized_memory)
    torch.backends.cudnn.benchmark = not enabled
    torch.backends.cudnn.deterministic = enabled
    return before


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
