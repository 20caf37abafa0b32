"""Qwen3.5 dense text model (``Qwen3_5ForCausalLM``), parameter names identical to transformers.

Plain PyTorch, no distributed code: ``parallelize.py`` cuts it. The layer stack is an
``nn.ModuleDict`` keyed "0".."L-1" so a pipeline stage can delete layers, and forward runs on
whatever is left (no embedding → the input is already hidden states; no norm/head → hidden
states out).
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.models.layers.lm_head import LMHead
from hyperpar.models.layers import (
    Attention,
    Documents,
    GatedDeltaNet,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    init_param_by_module,
)
from hyperpar.models.layers.gated_deltanet import delta_rule_macs_per_token
from hyperpar.models.qwen3_5.args import LINEAR, Qwen3_5Args


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + Mixer(norm(x)); y = h + MLP(norm(h))``; Mixer is GatedDeltaNet
    (``linear_attn``) or gated attention (``self_attn``) by layer type. The unit for FSDP and
    activation checkpointing."""

    def __init__(self, args: Qwen3_5Args, layer_idx: int, layer_type: str | None = None) -> None:
        super().__init__()
        # layer_type overrides the args' entry (an MTP block is a full-attention layer outside the stack)
        self.layer_type = layer_type or args.layer_types[layer_idx]
        H, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, offset=True)
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(
                H,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                args.linear_conv_kernel_dim,
                eps=eps,
            )
        else:
            self.self_attn = Attention(
                H,
                args.num_attention_heads,
                args.num_key_value_heads,
                args.head_dim,
                eps=eps,
                output_gate=True,
                norm_offset=True,
                bias=args.attention_bias,
            )
        self.post_attention_layernorm = RMSNorm(H, eps, offset=True)
        self.mlp = self.build_mlp(args)

    def build_mlp(self, args: Qwen3_5Args) -> nn.Module:
        """The FFN; a MoE family overrides this."""
        return SwiGLUMLP(args.hidden_size, args.intermediate_size)

    def ffn(self, h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """The FFN on the normed hidden states; a MoE family passes ``token_mask`` to its router."""
        return self.mlp(h)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        doc: Documents | None = None,
    ) -> torch.Tensor:
        """x: (B, S, H); cos/sin: (B, S, rot) from the model's rotary (unused by GDN layers);
        token_mask: optional (B, S), nonzero = real token (only MoE router statistics read it);
        doc: packed documents (None: one per row), kept apart by attention, GDN state and conv."""
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, doc=doc)
        else:
            h = self.self_attn(h, cos, sin, doc=doc)
        x = x + h
        return x + self.ffn(self.post_attention_layernorm(x), token_mask)


class Qwen3_5TextModel(nn.Module):
    """Embedding → decoder layers → final norm (``model.*`` in the checkpoint)."""

    layer_cls = Qwen3_5DecoderLayer  # a MoE family swaps in its own block

    def __init__(self, args: Qwen3_5Args) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id
        )
        self.layers = nn.ModuleDict({str(i): self.layer_cls(args, i) for i in range(args.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=True)
        # Owned here, not by the layers: cos/sin are computed once per forward and passed down.
        self.rotary_emb = RotaryEmbedding(
            args.head_dim, args.rope_theta, args.partial_rotary_factor, args.mrope_section
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: (B, S) token ids, or (B, S, H) floating-point input embeddings / hidden states
        (a VL model's merged text+vision embeddings, or a later pipeline stage's input).

        Documents (once per forward): a position restarting at 0 starts one, and so does every
        change of ``token_mask`` (padding is a span of its own)."""
        h = input_ids if input_ids.is_floating_point() else self.embed_tokens(input_ids)
        doc = Documents.from_positions(position_ids, token_mask)
        if position_ids is None:
            B, S = h.shape[:2]
            position_ids = torch.arange(S, device=h.device).unsqueeze(0).expand(B, S)
        cos, sin = self.rotary_emb(position_ids, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, token_mask, doc=doc)
        if self.norm is not None:
            h = self.norm(h)
        return h


class Qwen3_5ForCausalLM(nn.Module):
    """``forward(input_ids, position_ids=None, attention_mask=None) -> logits`` (B, S, V) in the
    activation dtype (a ``HeadInput`` instead when the trainer fuses the head with the loss:
    ``models/layers/lm_head.py``).

    position_ids: None (0..S−1), (B, S), (3, B, S) rows T/H/W, or (4, B, S) with a text row first.
    Packed documents: within a row, a (text-row) position restarting at 0 starts a new document;
    attention, GatedDeltaNet state and conv stay inside each one. attention_mask (B, S), 1 = real
    token: padding runs become documents of their own (no real token attends to them).
    """

    text_model_cls = Qwen3_5TextModel  # a MoE family swaps in its own stack

    def __init__(self, args: Qwen3_5Args) -> None:
        super().__init__()
        self.args = args
        self.model = self.text_model_cls(args)
        self.lm_head: nn.Linear | None = LMHead(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with the embedding when the args say so and both exist here.

        Needed again after ``to_empty``: it materialises each module's parameters separately and
        so unties them.
        """
        if self.args.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.model(input_ids, position_ids, attention_mask)
        return self.lm_head(h) if self.lm_head is not None else h

    # --- framework hooks (see hyperpar.models.spec) -----------------------------------------

    def init_param(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill the full-shaped fp32 tensor of parameter ``name`` in place (a pure function of gen)."""
        init_param_by_module(self, name, full, gen, std=self.args.initializer_range)

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers on the current device and restore the weight tie."""
        self.model.rotary_emb.reset_buffers()
        self.tie_weights()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PERF_NOTES.md's formula (see ``text_flops``)."""
        return self.text_flops(self.args, seq_len)

    @classmethod
    def text_flops(cls, a: Qwen3_5Args, seq_len: int) -> float:
        """Training FLOPs per token of the text model with geometry ``a``:

        6 × (non-embedding parameters, lm_head counted even when tied, since its matmul runs)
        + 12 × full layers × nh × hd × seq (attention scores and values)
        + the gated-delta-rule chunk matmuls at chunk 64 (``delta_rule_macs_per_token``), × 2 FLOPs
        × 3 for forward + backward.
        """
        H, V = a.hidden_size, a.vocab_size
        mlp = cls.ffn_active_params(a) + 2 * H  # + the two decoder norms
        nh, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        attn = H * 2 * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd
        nk, nv, dk, dv, kc = (
            a.linear_num_key_heads,
            a.linear_num_value_heads,
            a.linear_key_head_dim,
            a.linear_value_head_dim,
            a.linear_conv_kernel_dim,
        )
        conv_dim = 2 * nk * dk + nv * dv
        gdn = H * conv_dim + conv_dim * kc + H * nv * dv + 2 * H * nv + 2 * nv + dv + nv * dv * H
        params = a.num_full_layers * (attn + mlp) + a.num_linear_layers * (gdn + mlp) + H + V * H
        gdn_macs = delta_rule_macs_per_token(nv, dk, dv)
        return float(
            6 * params + 12 * a.num_full_layers * nh * hd * seq_len + 6 * a.num_linear_layers * gdn_macs
        ) + cls.extra_flops(a, seq_len)

    @classmethod
    def ffn_active_params(cls, a: Qwen3_5Args) -> int:
        """Parameters of one decoder layer's FFN that every token multiplies with."""
        return 3 * a.hidden_size * a.intermediate_size

    @classmethod
    def extra_flops(cls, a: Qwen3_5Args, seq_len: int) -> float:
        """Training FLOPs per token outside the decoder stack and head (e.g. an MTP module)."""
        return 0.0
