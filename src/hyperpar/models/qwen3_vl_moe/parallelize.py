"""How Qwen3-VL-MoE is cut: the shared VL plans (``qwen3_5/parallelize_vl.py``: text decoder TP/SP,
experts split on their intermediate dim, DeepStack injection on whole sequences, vision tower
replicated or TP'd) -> (CP/EP/PP later) -> activation checkpointing -> FSDP per text decoder
layer and per vision block."""

from __future__ import annotations

from hyperpar.models.qwen3_5.parallelize_vl import parallelize_vl as parallelize_qwen3_vl_moe

__all__ = ["parallelize_qwen3_vl_moe"]
