"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``), parameter names identical to transformers.

    model.visual           VisionTower (shared with the Qwen3.5 VL models), DeepStack mergers
    model.language_model   embed_tokens → layers (full attention + MoE / dense FFN) → norm
    lm_head

Text decoder (MODELS.md 7): every layer is pre-norm full attention without output gate, plain
RMSNorms, q/k norms, full-head-dim interleaved mRoPE; the FFN is the routed-expert block of
``layers/moe.py`` (no shared expert) or a dense SwiGLU MLP on ``mlp_only_layers`` / off the
``decoder_sparse_step`` grid. DeepStack feature n is added at the visual positions after text layer n.

Plain PyTorch, no distributed code: ``parallelize.py`` cuts it. Text layers and vision blocks are
``nn.ModuleDict``s keyed by their index, so a pipeline stage can drop entries and activation
checkpointing / FSDP wrap them one by one.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.models.layers.lm_head import LMHead
from hyperpar.models.layers import (
    Attention,
    Documents,
    RMSNorm,
    RotaryEmbedding,
    SparseMoeBlock,
    SwiGLUMLP,
    record_router_stats,
)
from hyperpar.models.multimodal import (
    VisionLanguageHooks,
    DeepStackInjection,
    deepstack_inputs,
    get_rope_index,
    scatter_features,
    tower_features,
)
from hyperpar.models.output import ModelOutput
from hyperpar.models.qwen3_vl_moe.args import Qwen3VLMoeArgs, Qwen3VLMoeTextArgs
from hyperpar.models.vision import VisionTower


class Qwen3VLMoeDecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); y = h + ffn(norm(h))``. The unit for FSDP and activation checkpointing."""

    def __init__(self, args: Qwen3VLMoeTextArgs, layer_idx: int) -> None:
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, offset=False)
        self.self_attn = Attention(
            H,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            eps=eps,
            output_gate=False,
            norm_offset=False,
            bias=args.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(H, eps, offset=False)
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp: nn.Module
        if self.is_moe:
            self.mlp = SparseMoeBlock(H, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size)
        else:
            self.mlp = SwiGLUMLP(H, args.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        doc: Documents | None = None,
    ) -> torch.Tensor:
        """x: (B, S, H); cos/sin: (B, S, hd) from the text rotary; token_mask (B, S) nonzero = real
        token (router statistics only); doc: packed documents (None: one per row)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, doc=doc)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, token_mask) if self.is_moe else self.mlp(h))


class Qwen3VLMoeTextModel(nn.Module):
    """``model.language_model``: embedding, decoder layers with DeepStack injection, final norm."""

    def __init__(self, args: Qwen3VLMoeTextArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens: nn.Embedding | None = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.layers = nn.ModuleDict({str(i): Qwen3VLMoeDecoderLayer(args, i) for i in range(args.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=False)
        # Owned here, not by the layers: cos/sin are computed once per forward and passed down.
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope_theta, 1.0, args.mrope_section)
        self.deepstack = DeepStackInjection()

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (B, S, H) input embeddings (or a previous stage's hidden states).

        position_ids: None (0..S−1), (B, S), (3, B, S) T/H/W rows or (4, B, S) with a text row first
        (a restart at 0 there starts a packed document). deepstack[n] (n_visual, H) is added at
        ``visual_mask`` (B, S) after the layer with index n. attention_mask (B, S), 1 = real token:
        padding leaves the router statistics and is a document of its own.
        """
        doc = Documents.from_positions(position_ids, attention_mask)
        if position_ids is None:
            B, S = hidden.shape[:2]
            position_ids = torch.arange(S, device=hidden.device).unsqueeze(0).expand(B, S)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        for name, layer in self.layers.items():
            hidden = layer(hidden, cos, sin, attention_mask, doc=doc)
            i = int(name)
            if i < len(deepstack):
                hidden = self.deepstack(hidden, visual_mask, deepstack[i])
        return self.norm(hidden) if self.norm is not None else hidden


class Qwen3VLMoeModel(nn.Module):
    """``model``: the vision tower, the placeholder scatter, 3-D positions and the text decoder."""

    def __init__(self, args: Qwen3VLMoeArgs) -> None:
        super().__init__()
        self.args = args
        self.visual: VisionTower | None = VisionTower(args.vision)
        self.language_model = Qwen3VLMoeTextModel(args.text)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lm = self.language_model
        if lm.embed_tokens is None:  # a later pipeline stage: input_ids are hidden states
            return lm(input_ids, position_ids, attention_mask=attention_mask)
        embeds, position_ids, visual_mask, deepstack = self.embed(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, mm_token_type_ids, position_ids,
            attention_mask)
        return lm(embeds, position_ids, visual_mask, deepstack, attention_mask)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
              mm_token_type_ids=None, position_ids=None, attention_mask=None):
        """(merged input embeddings (B, S, H), positions, the visual mask (B, S) or None, the DeepStack
        features per level): everything before the text decoder."""
        lm = self.language_model
        a = self.args
        embeds = lm.embed_tokens(input_ids)
        image, video = tower_features(self.visual, self.args.vision.merge_unit, pixel_values, image_grid_thw,
                                      pixel_values_videos, video_grid_thw)
        image_mask = video_mask = None
        if image is not None:
            image_mask = input_ids == a.image_token_id
            embeds = scatter_features(embeds, image_mask, image[0], "image")
        if video is not None:
            video_mask = input_ids == a.video_token_id
            embeds = scatter_features(embeds, video_mask, video[0], "video")
        visual_mask, deepstack = deepstack_inputs(
            image_mask, video_mask, image[1] if image else [], video[1] if video else []
        )
        if position_ids is None and (image_grid_thw is not None or video_grid_thw is not None):
            position_ids, _ = get_rope_index(
                input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
                spatial_merge_size=a.vision.spatial_merge_size, attention_mask=attention_mask,
            )
        return embeds, position_ids, visual_mask, deepstack


class Qwen3VLMoeForConditionalGeneration(VisionLanguageHooks, nn.Module):
    """``forward(input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
    video_grid_thw=None, mm_token_type_ids=None, position_ids=None, attention_mask=None) -> ModelOutput``.

    ``logits`` (B, S, V) in the activation dtype; ``aux_loss`` = router_aux_loss_coef × the
    load-balancing loss pooled over all MoE layers and tokens of this call (None without MoE
    layers; padding left out when ``attention_mask`` (B, S), 1 = real token, is given). Packed
    documents come from (B, S) or 4-row positions (text row restarting at 0, see ``Documents``).
    """

    def __init__(self, args: Qwen3VLMoeArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Qwen3VLMoeModel(args)
        self.lm_head: nn.Linear | None = LMHead(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    # --- embeddings (tying and init: VisionLanguageHooks) -------------------------------------

    def get_input_embeddings(self) -> nn.Embedding | None:
        return self.model.language_model.embed_tokens

    def set_input_embeddings(self, embedding: nn.Embedding) -> None:
        self.model.language_model.embed_tokens = embedding
        self.tie_weights()

    # --- forward ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> ModelOutput:
        # Every MoE block publishes its router statistics into this context; the aux loss pools them
        # over all layers before the product (it is not a sum of per-layer losses).
        with record_router_stats() as stats:
            hidden = self.model(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, mm_token_type_ids, position_ids,
                attention_mask,
            )
        logits = self.lm_head(hidden) if self.lm_head is not None else hidden
        return ModelOutput.of(logits, stats, self.args.text.router_aux_loss_coef)

    # --- pipeline stage hooks (hyperpar.distributed.pipeline) --------------------------------

    def stage_embed(self, input_ids, position_ids=None, attention_mask=None, **vision):
        """The first stage's input: (merged embeddings, visual mask or None, DeepStack features per level)."""
        embeds, _, visual_mask, deepstack = self.model.embed(input_ids, position_ids=position_ids,
                                                             attention_mask=attention_mask, **vision)
        return embeds, visual_mask, list(deepstack)

    def stage_text(self, hidden, position_ids, attention_mask, visual_mask, deepstack):
        """The stage's decoder layers; ``deepstack[n]`` (None where no layer of the stage reads it)."""
        return self.model.language_model(hidden, position_ids, visual_mask, deepstack, attention_mask)

    # --- framework hooks (see hyperpar.models.spec) -----------------------------------------

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token (forward + backward): 6 × active non-embedding parameters
        (top-k experts, lm_head counted) + 12 × layers × nh × hd × seq for the attention scores.
        The vision tower is not included (its cost depends on the images per token)."""
        t = self.args.text
        H, V = t.hidden_size, t.vocab_size
        nh, nkv, hd = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd + 2 * H
        moe = t.num_experts_per_tok * 3 * H * t.moe_intermediate_size + t.num_experts * H
        dense = 3 * H * t.intermediate_size
        n_moe = len(t.moe_layers)
        params = t.num_hidden_layers * attn + n_moe * moe + (t.num_hidden_layers - n_moe) * dense + H + V * H
        return float(6 * params + 12 * t.num_hidden_layers * nh * hd * seq_len)
