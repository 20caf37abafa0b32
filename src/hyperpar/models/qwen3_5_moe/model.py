"""Qwen3.5-MoE: the text model (``Qwen3_5MoeForCausalLM``) — the dense Qwen3.5 stack with the sparse
MoE block as the FFN of every layer, plus the optional multi-token-prediction module ``mtp.*`` — and
the vision-language model (``Qwen3_5MoeForConditionalGeneration``): the shared vision tower
(``model.visual``) in front of the same text model (``model.language_model``).

Parameter names are transformers' (``model.layers.{i}.mlp.gate.weight``,
``mlp.experts.gate_up_proj`` …); ``mtp.*`` follows the released checkpoints (MODELS.md 11).

forward returns ``ModelOutput(logits, aux_loss, mtp_logits)``:
- ``aux_loss`` = ``router_aux_loss_coef`` × the load-balancing loss with f and P pooled over every
  MoE layer that ran in this call (MODELS.md 6.3; the MTP layer's router counts too when MTP runs),
  padding excluded when ``attention_mask`` is given;
- ``mtp_logits`` (B, S−1, V), only when ``mtp_loss_weight`` > 0: position t sees the main model's
  final hidden state at t (after the final norm, the one ``lm_head`` reads — the inference
  engines' convention) and the embedding of token t+1, and predicts token t+2, i.e. the
  pre-shifted ``labels[:, t + 1]``.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.models.layers.cpu_matmul import Linear
from hyperpar.models.layers import Documents, RMSNorm, SparseMoeBlock, mtp_stream_rows, record_router_stats
from hyperpar.models.output import ModelOutput
from hyperpar.models.qwen3_5.args import FULL
from hyperpar.models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5TextModel
from hyperpar.models.qwen3_5.vl import Qwen3_5ForConditionalGeneration, Qwen3_5VLModel
from hyperpar.models.qwen3_5_moe.args import Qwen3_5MoeArgs, Qwen3_5MoeVLArgs


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """The dense block with ``mlp`` = routed experts + sigmoid-gated shared expert."""

    def build_mlp(self, args: Qwen3_5MoeArgs) -> nn.Module:  # type: ignore[override]
        return SparseMoeBlock(
            args.hidden_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.moe_intermediate_size,
            args.shared_expert_intermediate_size,
            experts_impl=args.experts_impl,
        )

    def ffn(self, h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        return self.mlp(h, token_mask)


class Qwen3_5MoeTextModel(Qwen3_5TextModel):
    layer_cls = Qwen3_5MoeDecoderLayer


def shift_positions(position_ids: torch.Tensor | None, B: int, S: int, device: torch.device) -> torch.Tensor:
    """Positions of tokens 1..S−1 (the tokens the MTP step reads), in any accepted format."""
    if position_ids is None:
        return torch.arange(1, S, device=device).unsqueeze(0).expand(B, S - 1)
    return position_ids[..., 1:]


class Qwen3_5MoeMTP(nn.Module):
    """``mtp.*``: ``h = fc([norm_e(embed(x_{t+1})); norm_h(hidden_t)])`` → full-attention MoE decoder
    layer → ``norm``; the caller applies the shared ``lm_head``. All norms are offset norms."""

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(H, eps, offset=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, offset=True)
        self.fc = Linear(2 * H, H, bias=False)  # input order: [embedding; hidden]
        self.layers = nn.ModuleDict(
            {str(n): Qwen3_5MoeDecoderLayer(args, 0, layer_type=FULL) for n in range(args.mtp_num_hidden_layers)}
        )
        self.norm = RMSNorm(H, eps, offset=True)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        doc: Documents | None = None,
    ) -> torch.Tensor:
        """inputs_embeds: the embeddings of tokens 0..S−1, hidden: the main model's final hidden
        states 0..S−1, both full (B, S, H); the one-token shift happens here, after any
        parallelizer has handed this module whole sequences. cos/sin and token_mask (B, S−1) are
        for the positions of tokens 1..S−1. Returns (B, S−1, H) normed."""
        next_embeds, hidden = inputs_embeds[:, 1:], hidden[:, :-1]
        h = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        h = self.layers["0"](h, cos, sin, token_mask, doc=doc)
        return self.norm(h)

    def predict(
        self,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        rotary: nn.Module,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The depth-1 MTP hidden states (B, S−1, H) from full-sequence tensors: the input embeddings
        the main model consumed (B, S, H), its final hidden states (B, S, H), the main model's rotary
        module, positions in any accepted format and the optional (B, S) mask."""
        B, S = inputs_embeds.shape[:2]
        pos = shift_positions(position_ids, B, S, inputs_embeds.device)
        cos, sin = rotary(pos, inputs_embeds.dtype)
        doc = Documents.from_positions(position_ids, attention_mask)  # packed rows: see shifted_for_mtp
        # A row whose two tokens are not both real, or lie in two documents, is left out of the router
        # statistics (the objective masks its target the same way): no document alone has it.
        mask = mtp_stream_rows(position_ids, attention_mask) if doc is not None or attention_mask is not None else None
        return self(inputs_embeds, hidden, cos, sin, mask, doc=doc.shifted_for_mtp() if doc is not None else None)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """``forward(input_ids, position_ids=None, attention_mask=None) -> ModelOutput``.

    As the dense model's: packed documents (positions restarting at 0) and attention_mask (B, S),
    1 = real token, padding on either side, kept apart from real tokens; padding is also left out of
    the router statistics. Without an
    ``lm_head`` (a pipeline stage) forward returns the hidden states like the dense model.
    """

    text_model_cls = Qwen3_5MoeTextModel

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args)
        self.mtp: Qwen3_5MoeMTP | None = Qwen3_5MoeMTP(args) if args.mtp_num_hidden_layers > 0 else None

    @property
    def mtp_active(self) -> bool:
        return (
            self.args.mtp_loss_weight > 0
            and self.mtp is not None
            and self.lm_head is not None
            and self.model.embed_tokens is not None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        with record_router_stats() as stats:
            h = self.model(input_ids, position_ids, attention_mask)
            if self.lm_head is None:
                return h
            logits = self.lm_head(h)
            mtp_logits = None
            if self.mtp_active:
                embeds = self.model.embed_tokens(input_ids)
                mtp_h = self.mtp.predict(embeds, h, self.model.rotary_emb, position_ids, attention_mask)
                mtp_logits = self.lm_head(mtp_h)
        return ModelOutput.of(logits, stats, self.args.router_aux_loss_coef, mtp_logits)

    # --- framework hooks -------------------------------------------------------------------------

    @classmethod
    def ffn_active_params(cls, a: Qwen3_5MoeArgs) -> int:  # type: ignore[override]
        H = a.hidden_size
        routed = a.num_experts_per_tok * 3 * H * a.moe_intermediate_size
        shared = 3 * H * a.shared_expert_intermediate_size + (H if a.shared_expert_intermediate_size else 0)
        return H * a.num_experts + routed + shared  # router + active experts + shared expert and gate

    @classmethod
    def extra_flops(cls, a: Qwen3_5MoeArgs, seq_len: int) -> float:  # type: ignore[override]
        """The MTP step when it trains: fc, one full-attention MoE layer, norms and a second lm_head."""
        if not a.mtp_enabled:
            return 0.0
        H, V = a.hidden_size, a.vocab_size
        nh, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        attn = H * 2 * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd
        params = 2 * H * H + 3 * H + attn + cls.ffn_active_params(a) + 2 * H + V * H
        return float(6 * params + 12 * nh * hd * seq_len)


# --- vision-language ---------------------------------------------------------------------------------


class Qwen3_5MoeVLModel(Qwen3_5VLModel):
    """``model``: vision tower, placeholder scatter, 3-D positions, MoE text decoder (no DeepStack)."""

    text_model_cls = Qwen3_5MoeTextModel


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """``forward(input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
    video_grid_thw=None, mm_token_type_ids=None, position_ids=None, attention_mask=None) -> ModelOutput``.

    The dense VL model with the MoE text stack and the MTP module. Same outputs as
    ``Qwen3_5MoeForCausalLM`` (logits, aux_loss, mtp_logits); the MTP step reads the merged input
    embeddings (vision features at placeholder positions) and the 3-D positions. Without an
    embedding (a later pipeline stage) input_ids are hidden states; without an ``lm_head`` forward
    returns hidden states.
    """

    vl_model_cls = Qwen3_5MoeVLModel

    def __init__(self, args: Qwen3_5MoeVLArgs) -> None:
        super().__init__(args)
        self.mtp: Qwen3_5MoeMTP | None = Qwen3_5MoeMTP(args.text) if args.text.mtp_num_hidden_layers > 0 else None

    @property
    def mtp_active(self) -> bool:
        return self.args.mtp_loss_weight > 0 and self.mtp is not None and self.lm_head is not None

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        lm = self.model.language_model
        with record_router_stats() as stats:
            embeds, position_ids = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                              video_grid_thw, mm_token_type_ids, position_ids, attention_mask)
            h = lm(embeds, position_ids, attention_mask)
            if self.lm_head is None:
                return h
            logits = self.lm_head(h)
            mtp_logits = None
            if self.mtp_active and lm.embed_tokens is not None:
                mtp_h = self.mtp.predict(embeds, h, lm.rotary_emb, position_ids, attention_mask)
                mtp_logits = self.lm_head(mtp_h)
        return ModelOutput.of(logits, stats, self.args.text.router_aux_loss_coef, mtp_logits)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token of the text model (and MTP when it trains); the vision
        tower is not included (its cost depends on the images per token)."""
        return Qwen3_5MoeForCausalLM.text_flops(self.args.text_for_mtp, seq_len)
