"""The one copy of the tests' tiny configs: HF config.json dicts (tiny_configs/*.json of MODELS.md 14)
and the CLI overrides of a tiny training run. Tests import from here; no test file imports another.

Every dict is returned by a function that deep-copies it, so a test that edits its copy cannot leak
the change into another test.
"""

from __future__ import annotations

import copy
from typing import Any

# --- training runs through the CLI / run_job ------------------------------------------------------

# A tiny run: debug model, 16 tokens x 4 samples per step, one thread per rank.
SMALL = ["train.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=1", "launch.threads_per_rank=1"]
CKPT = ["checkpoint=default", "checkpoint.save_steps=5"]
STEPS = 20
# metrics.jsonl fields that are functions of the config alone (not of time or memory).
DETERMINISTIC = ("step", "loss", "grad_norm", "lr", "tokens", "tokens_seen")

# --- HF configs -------------------------------------------------------------------------------------

# tiny_configs/qwen3_5_causal_lm.json: L F L F, tied, θ 1e7, partial 0.25 → rot 16, mrope [3, 3, 2],
# dk 16 ≠ dv 32, nv = 2·nk.
_QWEN3_5: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "dtype": "float32",
    "eos_token_id": None,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 4096,
    "model_type": "qwen3_5_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "rope_type": "default",
    },
    "tie_word_embeddings": True,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "vocab_size": 1024,
}

# tiny_configs/qwen3_5_moe_causal_lm.json: L F L F, E 8, k 2, Ie 48 ≠ Is 32, untied.
_QWEN3_5_MOE: dict[str, Any] = {
    **{k: v for k, v in _QWEN3_5.items() if k != "intermediate_size"},
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 32,
    "tie_word_embeddings": False,
}

# vision_config of tiny_configs/qwen3_vl_moe.json: depth 3, DeepStack on blocks 0 and 2.
_VL_MOE_VISION: dict[str, Any] = {
    "deepstack_visual_indexes": [0, 2],
    "depth": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "model_type": "qwen3_vl_moe_vision",
    "num_heads": 2,
    "num_position_embeddings": 64,
    "out_hidden_size": 64,
    "patch_size": 16,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# vision_config of tiny_configs/qwen3_5_moe_vl.json: the same tower, depth 2, without DeepStack.
_QWEN3_5_VISION: dict[str, Any] = {
    **{k: v for k, v in _VL_MOE_VISION.items() if k != "deepstack_visual_indexes"},
    "depth": 2,
    "model_type": "qwen3_5_moe_vision",
}

# Placeholder ids of both VL tiny configs.
IMG, VID, VS, VE = 1000, 1001, 1002, 1003

# tiny_configs/qwen3_5_moe_vl.json: the MoE text config above + the depth-2 ViT.
_QWEN3_5_MOE_VL: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "dtype": "float32",
    "image_token_id": IMG,
    "model_type": "qwen3_5_moe",
    "text_config": {k: v for k, v in _QWEN3_5_MOE.items() if k not in ("architectures", "dtype", "transformers_version")},
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "video_token_id": VID,
    "vision_config": _QWEN3_5_VISION,
    "vision_end_token_id": VE,
    "vision_start_token_id": VS,
}

# tiny_configs/qwen3_vl_moe.json: 4 full-attention MoE layers, hd 32, mrope [6, 5, 5], θ 5e6,
# E 8 / k 2 / Ie 48 (2·Ie ≠ H), ViT depth 3 with DeepStack on blocks [0, 2].
_QWEN3_VL_MOE: dict[str, Any] = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "dtype": "float32",
    "image_token_id": IMG,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "decoder_sparse_step": 1,
        "eos_token_id": None,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text",
        "moe_intermediate_size": 48,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [6, 5, 5],
            "rope_theta": 5000000.0,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 1024,
    },
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "video_token_id": VID,
    "vision_config": _VL_MOE_VISION,
    "vision_end_token_id": VE,
    "vision_start_token_id": VS,
}


def _copy(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(copy.deepcopy(changes))
    return cfg


def qwen3_5(**changes: Any) -> dict[str, Any]:
    """tiny_configs/qwen3_5_causal_lm.json with top-level ``changes``."""
    return _copy(_QWEN3_5, changes)


def qwen3_5_moe(**changes: Any) -> dict[str, Any]:
    """tiny_configs/qwen3_5_moe_causal_lm.json with top-level ``changes``."""
    return _copy(_QWEN3_5_MOE, changes)


def qwen3_5_moe_vl(**text_changes: Any) -> dict[str, Any]:
    """tiny_configs/qwen3_5_moe_vl.json with ``text_changes`` applied to its text_config."""
    cfg = copy.deepcopy(_QWEN3_5_MOE_VL)
    cfg["text_config"].update(copy.deepcopy(text_changes))
    return cfg


def qwen3_vl_moe(tie: bool = False, **text_changes: Any) -> dict[str, Any]:
    """tiny_configs/qwen3_vl_moe.json; ``tie`` sets tie_word_embeddings, ``text_changes`` edit text_config."""
    cfg = copy.deepcopy(_QWEN3_VL_MOE)
    cfg["tie_word_embeddings"] = tie
    cfg["text_config"].update(copy.deepcopy(text_changes))
    return cfg


def vl_moe_vision(**changes: Any) -> dict[str, Any]:
    """The vision_config of tiny_configs/qwen3_vl_moe.json (DeepStack on blocks 0 and 2)."""
    return _copy(_VL_MOE_VISION, changes)


def qwen3_5_vision(**changes: Any) -> dict[str, Any]:
    """The vision_config of tiny_configs/qwen3_5_moe_vl.json (no DeepStack)."""
    return _copy(_QWEN3_5_VISION, changes)
