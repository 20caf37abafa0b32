"""How Qwen3.5-MoE (text and VL) is cut: the dense family's plans (its tree is the dense tree with
MoE FFNs: routed experts split on their intermediate dim, router and shared-expert gate replicated,
shared expert like an MLP; the MTP head on whole sequences) -> (CP/EP/PP later) -> activation
checkpointing -> FSDP per decoder layer; the MTP decoder layer is a unit of its own (its fc and
norms stay in the root unit with the embedding and head)."""

from __future__ import annotations

from hyperpar.models.qwen3_5.parallelize import parallelize_qwen3_5 as parallelize_qwen3_5_moe
from hyperpar.models.qwen3_5.parallelize_vl import parallelize_vl as parallelize_qwen3_5_moe_vl

__all__ = ["parallelize_qwen3_5_moe", "parallelize_qwen3_5_moe_vl"]
