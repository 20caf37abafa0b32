"""Qwen3.5 dense vision-language model (``Qwen3_5ForConditionalGeneration``): the shared vision tower
(``model.visual``) in front of the dense text model (``model.language_model``), no DeepStack.

Parameter names are the checkpoint's (``model.language_model.layers.{i}.…``, ``model.visual.…``,
``lm_head.weight``). Inputs take transformers' names; 3-D (T, H, W) positions are built from the
grids and ``mm_token_type_ids`` when no positions are given (MODELS.md 9).
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.models.layers.lm_head import LMHead
from hyperpar.models.multimodal import VisionLanguageHooks, embed_with_vision
from hyperpar.models.qwen3_5.args import Qwen3_5VLArgs
from hyperpar.models.qwen3_5.model import Qwen3_5ForCausalLM, Qwen3_5TextModel
from hyperpar.models.vision import VisionTower


class Qwen3_5VLModel(nn.Module):
    """``model``: the vision tower and the text decoder (``embed_with_vision`` joins them)."""

    text_model_cls = Qwen3_5TextModel  # a MoE family swaps in its own stack

    def __init__(self, args: Qwen3_5VLArgs) -> None:
        super().__init__()
        self.args = args
        self.visual: VisionTower | None = VisionTower(args.vision)
        self.language_model = self.text_model_cls(args.text)


class Qwen3_5ForConditionalGeneration(VisionLanguageHooks, nn.Module):
    """``forward(input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
    video_grid_thw=None, mm_token_type_ids=None, position_ids=None, attention_mask=None) -> logits``.

    logits (B, S, V) in the activation dtype. attention_mask (B, S), 1 = real token, keeps padding
    out of the 3-D positions and makes each padding run a document of its own; packed documents
    come from 4-row positions (text row restarting at 0, see ``Documents``). Without an
    embedding (a later pipeline stage) input_ids are hidden states; without an ``lm_head`` forward
    returns hidden states.
    """

    vl_model_cls = Qwen3_5VLModel  # a MoE family swaps in its own text stack

    def __init__(self, args: Qwen3_5VLArgs) -> None:
        super().__init__()
        self.args = args
        self.model = self.vl_model_cls(args)
        self.lm_head: nn.Linear | None = LMHead(args.text.hidden_size, args.text.vocab_size, bias=False)
        self.tie_weights()

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the text model's input, positions): merged embeddings, or ``input_ids`` as they are when
        they already are hidden states (a later pipeline stage, no embedding)."""
        if self.model.language_model.embed_tokens is None or input_ids.is_floating_point():
            return input_ids, position_ids
        return embed_with_vision(
            self.model.language_model.embed_tokens, self.model.visual, self.args, input_ids, pixel_values,
            image_grid_thw, pixel_values_videos, video_grid_thw, mm_token_type_ids, position_ids, attention_mask,
        )

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
        embeds, position_ids = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                          video_grid_thw, mm_token_type_ids, position_ids, attention_mask)
        h = self.model.language_model(embeds, position_ids, attention_mask)
        return self.lm_head(h) if self.lm_head is not None else h

    # --- pipeline stage hooks (hyperpar.distributed.pipeline) --------------------------------

    def stage_embed(self, input_ids, position_ids=None, attention_mask=None, **vision):
        """The first stage's input: (merged embeddings, no visual mask, no DeepStack features)."""
        embeds, _ = self.embed(input_ids, vision.get("pixel_values"), vision.get("image_grid_thw"),
                               vision.get("pixel_values_videos"), vision.get("video_grid_thw"), None, position_ids,
                               attention_mask)
        return embeds, None, []

    def stage_text(self, hidden, position_ids, attention_mask, visual_mask, deepstack):
        return self.model.language_model(hidden, position_ids, attention_mask)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token of the text model; the vision tower is not included (its
        cost depends on the images per token)."""
        return Qwen3_5ForCausalLM.text_flops(self.args.text, seq_len)
