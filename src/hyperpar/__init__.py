"""hyperpar: train Qwen3.5 / Qwen3.5-MoE / Qwen3-VL-MoE under any parallel layout, provably equal to one process."""

__version__ = "0.1.0"
