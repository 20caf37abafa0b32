"""Full softmax attention: the attention core (SDPA) and the Qwen projection block around it.

``AttentionCore`` (a module around ``attention_core``) is the single seam where the attention
kernel sits, so context parallelism (Ulysses all-to-all) can wrap it and a GPU build can swap the
kernel without touching the projections.

Packed documents (``doc``, a :class:`~hyperpar.models.layers.documents.Documents`) make attention
block-diagonal: causal within each document only. On CUDA in half precision that is flash
attention's varlen kernel; elsewhere one causal SDPA call per document when documents are long
(each costs its own L², far less than the row's S²), else SDPA with a (B, 1, S, S) block-causal mask.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from hyperpar.models.layers.cpu_matmul import Linear, upcast
from hyperpar.models.layers.documents import Documents
from hyperpar.models.layers.norms import RMSNorm
from hyperpar.models.layers.rope import apply_rotary


# Below this mean document length the per-document SDPA calls cost more in dispatch than the mask
# path wastes on cross-document blocks.
PER_DOCUMENT_MIN_MEAN_LENGTH = 64


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float,
    doc: Documents | None = None,
    doc_impl: str = "auto",
) -> torch.Tensor:
    """Softmax attention with GQA.

    q: (B, S, nh, hd); k, v: (B, S_kv, nkv, hd) with nh a multiple of nkv, kv head j serving query
    heads j·nh/nkv … (j+1)·nh/nkv − 1. Returns (B, S, nh, hd). ``doc``: packed documents of the
    (B, S) batch (needs causal, S_kv = S); ``doc_impl``: "auto", "varlen", "split" (one SDPA per
    document) or "mask" (block-causal mask), all giving the same result.
    """
    if upcast(q):  # no 16-bit GEMM on this CPU: the kernel in fp32 on the 16-bit values, rounded back
        out = attention_core(q.float(), k.float(), v.float(), causal=causal, scale=scale, doc=doc, doc_impl=doc_impl)
        return out.to(q.dtype)
    nh, nkv = q.shape[2], k.shape[2]
    gqa = nh != nkv
    if doc is not None:
        if not causal or k.shape[1] != q.shape[1]:
            raise ValueError("packed documents need causal self-attention")
        return _document_attention(q, k, v, scale, gqa, doc, doc_impl)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=gqa,
    )  # (B, nh, S, hd)
    return out.transpose(1, 2)


@functools.cache
def _varlen_has_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool, doc: Documents, impl: str
) -> torch.Tensor:
    B, S, nh, hd = q.shape
    if impl == "auto":
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            impl = "varlen"
        elif B * S >= PER_DOCUMENT_MIN_MEAN_LENGTH * doc.num_documents:
            impl = "split"
        else:
            impl = "mask"
    if impl == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        cu, L = doc.cu_seqlens, doc.max_seqlen
        k, v = k.reshape(B * S, -1, hd), v.reshape(B * S, -1, hd)
        gqa_kw = {"enable_gqa": gqa} if _varlen_has_gqa() else {}
        if gqa and not gqa_kw:  # an older torch's kernel wants one k/v head per query head
            k, v = (t.repeat_interleave(nh // t.shape[1], dim=1) for t in (k, v))
        out = varlen_attn(q.reshape(B * S, nh, hd), k, v, cu, cu, L, L, scale=scale, window_size=(-1, 0), **gqa_kw)
        return out.view(B, S, nh, hd)
    if impl == "split":
        # split() is one autograd node: its backward concatenates the per-document gradients instead
        # of zero-filling a full-size gradient per slice.
        parts = zip(*(t.reshape(B * S, t.shape[2], hd).split(doc.lengths) for t in (q, k, v)))
        outs = [
            F.scaled_dot_product_attention(
                qd.transpose(0, 1).unsqueeze(0), kd.transpose(0, 1).unsqueeze(0), vd.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=gqa,
            )[0].transpose(0, 1)  # (L, nh, hd)
            for qd, kd, vd in parts
        ]
        return torch.cat(outs).view(B, S, nh, hd)
    if impl == "mask":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=doc.block_causal_mask(), scale=scale, enable_gqa=gqa,
        )
        return out.transpose(1, 2)
    raise ValueError(f"unknown document attention impl '{impl}' (auto | varlen | split | mask)")


class AttentionCore(nn.Module):
    """Causal softmax attention over (B, S, heads, hd) tensors; no parameters. Heads are
    independent, so a head-sharded slice of q (with the k/v heads it reads) gives that slice.
    ``doc`` (packed documents, per token) keeps each document to itself."""

    def __init__(self, scale: float, causal: bool = True) -> None:
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, doc: Documents | None = None
    ) -> torch.Tensor:
        return attention_core(q, k, v, causal=self.causal, scale=self.scale, doc=doc)

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
        self.q_proj = Linear(hidden_size, q_width, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset)
        self.core = AttentionCore(self.scale)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, doc: Documents | None = None
    ) -> torch.Tensor:
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
        out = self.core(q, k, v, doc=doc)  # (B, S, nh, hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(B, S, -1))
