"""The Qwen3-VL vision tower (``model.visual`` in the checkpoints), shared by the VL families.

ViT over flattened patches: patch embedding + interpolated learned positions, ``depth`` pre-LN blocks
with 2-D rotary and bidirectional attention inside each frame, a 2×2 patch merger to the text width,
and (Qwen3-VL-MoE) DeepStack mergers on the outputs of selected blocks. Parameter names are
transformers'. Plain PyTorch: ``blocks`` is an ``nn.ModuleDict`` keyed "0".."depth-1" so activation
checkpointing and FSDP can wrap each block like a text decoder layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.cpu_matmul import Linear, linear
from hyperpar.errors import DataError
from hyperpar.models.layers import init_param_by_module
from hyperpar.models.layers.attention import attention_core
from hyperpar.models.vision.args import VisionArgs
from hyperpar.models.vision.merger import PatchMerger
from hyperpar.models.vision.rotary import (
    apply_vision_rotary,
    frame_runs,
    patch_coords,
    position_interpolation,
    vision_rotary,
)


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (Tp, P, P) on one patch, i.e. a Linear on the flattened patch.

    The parameter keeps the checkpoint's Conv3d shape (Dv, C, Tp, P, P); the forward is one matmul
    on the (N, C·Tp·P·P) rows (no 5-D reshape of the input, no conv kernel).
    """

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden_size: int) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    """q/k/v projections, 2-D rotary in fp32, per-frame softmax, ``proj``.

    The checkpoint fuses q, k, v in one ``qkv`` (rows [q; k; v]); here they are three Linears so
    tensor parallelism can split all three by heads (``models/vision/state_dict.py`` fuses and
    unfuses them)."""

    def __init__(self, hidden_size: int, num_heads: int, rope_theta: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.rope_theta = rope_theta
        self.q = Linear(hidden_size, hidden_size, bias=True)
        self.k = Linear(hidden_size, hidden_size, bias=True)
        self.v = Linear(hidden_size, hidden_size, bias=True)
        self.proj = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, coords: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
        N = x.shape[0]
        hd = self.head_dim
        # -1 heads: a head-sharded (TP) block holds fewer
        q, k, v = (proj(x).view(N, -1, hd) for proj in (self.q, self.k, self.v))  # (N, heads, hd) each
        # cos/sin are rebuilt from the integer coordinates in every block: cheap, and they stay fp32
        # even when FSDP mixed precision casts the block's floating-point inputs.
        cos, sin = vision_rotary(coords, hd, self.rope_theta)
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        # Each run is `count` frames of `length` patches: one attention call with the frames as batch.
        outs, start = [], 0
        for count, length in runs:
            end = start + count * length
            seg = [t[start:end].view(count, length, -1, hd) for t in (q, k, v)]
            outs.append(attention_core(*seg, causal=False, scale=hd**-0.5).reshape(count * length, -1))
            start = end
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = Linear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """``x += attn(norm1(x)); x += mlp(norm2(x))`` with LayerNorm (eps 1e-6). The FSDP / AC unit."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args.hidden_size, args.num_heads, args.rope_theta)
        self.mlp = VisionMLP(args.hidden_size, args.intermediate_size, args.hidden_act)

    def forward(self, x: torch.Tensor, coords: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
        """x: (N, Dv) patches of all items; coords: (N, 2) patch (row, col); runs: see ``frame_runs``."""
        x = x + self.attn(self.norm1(x), coords, runs)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """``forward(pixel_values, grid_thw) -> (features, deepstack_features)``.

    pixel_values: (N, C·Tp·P·P), rows item by item, then temporal group, then merge-block order;
    grid_thw: (n_items, 3) patches per item. Returns features (N / m², Dout) in the same order and
    one (N / m², Dout) tensor per ``deepstack_visual_indexes`` entry (empty list without DeepStack).
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.spatial_merge_size = args.spatial_merge_size
        self.patch_embed = PatchEmbed(args.in_channels, args.temporal_patch_size, args.patch_size, args.hidden_size)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleDict({str(i): VisionBlock(args) for i in range(args.depth)})
        self.merger = PatchMerger(args.hidden_size, args.spatial_merge_size, args.out_hidden_size)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args.hidden_size, args.spatial_merge_size, args.out_hidden_size, postshuffle_norm=True)
            for _ in args.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        a = self.args
        rows = int(grid_thw.prod(-1).sum())
        if pixel_values.shape != (rows, a.patch_dim):
            raise DataError(
                f"pixel values of shape {tuple(pixel_values.shape)} do not match the grids "
                f"({rows} patches of width {a.patch_dim} expected)"
            )
        coords = patch_coords(grid_thw, a.spatial_merge_size, device=pixel_values.device)
        runs = frame_runs(grid_thw)
        index, weight = position_interpolation(grid_thw, coords, a.num_grid_per_side)
        h = self.patch_embed(pixel_values)
        pos = (self.pos_embed(index) * weight.unsqueeze(-1)).sum(1)  # fp32 weights: the blend is fp32
        h = h + pos.to(h.dtype)
        deepstack: list[torch.Tensor] = []
        for name, block in self.blocks.items():
            h = block(h, coords, runs)
            i = int(name)
            if i in a.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[a.deepstack_visual_indexes.index(i)](h))
        return self.merger(h), deepstack

    def init_param(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill parameter ``name`` (relative to the tower) like transformers' ``_init_weights``:
        Linear / Conv3d / Embedding weights ~ N(0, initializer_range), biases 0, LayerNorm (1, 0)."""
        init_param_by_module(self, name, full, gen, std=self.args.initializer_range)
