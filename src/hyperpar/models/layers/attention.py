"""Full softmax attention: the attention core (SDPA) and the Qwen projection block around it.

``AttentionCore`` (a module around ``attention_core``) is the single seam where the attention
kernel sits, so context parallelism (Ulysses all-to-all) can wrap it and a GPU build can swap the
kernel without touching the projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.norms import RMSNorm
from hyperpar.models.layers.rope import apply_rotary


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float
) -> torch.Tensor:
    """Softmax attention with GQA.

    q: (B, S, nh, hd); k, v: (B, S_kv, nkv, hd) with nh a multiple of nkv, kv head j serving query
    heads j·nh/nkv … (j+1)·nh/nkv − 1. Returns (B, S, nh, hd).
    """
    nh, nkv = q.shape[2], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=nh != nkv,
    )  # (B, nh, S, hd)
    return out.transpose(1, 2)


class AttentionCore(nn.Module):
    """Causal softmax attention over (B, S, heads, hd) tensors; no parameters. Heads are
    independent, so a head-sharded slice of q (with the k/v heads it reads) gives that slice."""

    def __init__(self, scale: float, causal: bool = True) -> None:
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_core(q, k, v, causal=self.causal, scale=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, causal={self.causal}"


class Attention(nn.Module):
    """Projections + q/k norm + rotary + core + optional sigmoid output gate.

    Qwen3.5: ``output_gate=True`` (q_proj is 2·nh·hd wide, per head [query hd; gate hd]),
    ``norm_offset=True``, partial rotary (set by the cos/sin width). Qwen3-VL-MoE: no gate, plain
    norms, full rotary.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float = 1e-6,
        output_gate: bool = True,
        norm_offset: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_gate = output_gate
        self.scale = head_dim**-0.5
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.core = AttentionCore(self.scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        hd = self.head_dim
        # -1 instead of num_heads: under tensor parallelism the local projections hold fewer heads.
        if self.output_gate:
            qg = self.q_proj(x).view(B, S, -1, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]  # (B, S, nh, hd) each
        else:
            q, gate = self.q_proj(x).view(B, S, -1, hd), None
        k = self.k_proj(x).view(B, S, -1, hd)
        v = self.v_proj(x).view(B, S, -1, hd)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        out = self.core(q, k, v)  # (B, S, nh, hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(B, S, -1))
