"""Packed vs unpacked step time: a full-attention block, a GatedDeltaNet block and a whole Qwen3.5
training step (forward, cross-entropy, backward, AdamW) on rows of ``--seq`` tokens, unpacked (one
document per row) or packed (``--docs`` documents per row, random lengths, positions restarting at
each). Steps alternate between the two (order swapped every step) so background load hits both
alike; medians are reported with the packed/unpacked ratio (target ≤ 1.2).

    python bench/packing_throughput.py --seq 1024 --batch 2 --docs 4 --steps 6
    python bench/packing_throughput.py --seq 64 --batch 1 --steps 2 --hidden 64 --layers 2   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from hyperpar.models.layers import Attention, Documents, GatedDeltaNet, RotaryEmbedding
from hyperpar.models.qwen3_5.args import Qwen3_5Args
from hyperpar.models.qwen3_5.model import Qwen3_5ForCausalLM


def packed_positions(batch: int, seq: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seq) positions of ``docs`` documents per row with random lengths (each ≥ 1)."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, seq]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(rows)


def model_args(a: argparse.Namespace) -> Qwen3_5Args:
    heads = max(1, a.hidden // 64)
    return Qwen3_5Args.from_hf_config(dict(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (a.layers // 4)
        or ["linear_attention", "full_attention"] * (a.layers // 2),
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, tie_word_embeddings=False,
        hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
    ))


def block_steps(args: Qwen3_5Args, batch: int, seq: int, positions: dict[str, torch.Tensor | None]):
    """name -> (variant -> step fn) for one attention and one GatedDeltaNet block, forward + backward."""
    torch.manual_seed(0)
    H = args.hidden_size
    attn = Attention(H, args.num_attention_heads, args.num_key_value_heads, args.head_dim)
    gdn = GatedDeltaNet(H, args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
                        args.linear_value_head_dim, args.linear_conv_kernel_dim)
    rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.partial_rotary_factor, args.mrope_section)
    x = torch.randn(batch, seq, H, requires_grad=True)
    out: dict[str, dict[str, Callable[[], None]]] = {"attention": {}, "gdn": {}}
    for variant, pos in positions.items():
        p = pos if pos is not None else torch.arange(seq).expand(batch, seq)

        def attn_step(p=p, pos=pos) -> None:
            doc = Documents.from_positions(pos)  # built per step, as the model does per forward
            cos, sin = rotary(p, x.dtype)
            attn(x, cos, sin, doc=doc).sum().backward()

        def gdn_step(pos=pos) -> None:
            gdn(x, doc=Documents.from_positions(pos)).sum().backward()

        out["attention"][variant] = attn_step
        out["gdn"][variant] = gdn_step
    return out


def model_steps(args: Qwen3_5Args, batch: int, seq: int, positions: dict[str, torch.Tensor | None]):
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab_size, (batch, seq))
    labels = torch.randint(0, args.vocab_size, (batch, seq))
    steps: dict[str, Callable[[], None]] = {}
    for variant, pos in positions.items():
        def step(pos=pos) -> None:
            logits = model(ids, position_ids=pos)
            F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[variant] = step
    return steps


def timed(fns: dict[str, Callable[[], None]], steps: int, warmup: int) -> dict[str, float]:
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(steps):
        for n in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--docs", type=int, default=4, help="documents per packed row")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    args = model_args(a)
    pos = {"unpacked": None, "packed": packed_positions(a.batch, a.seq, a.docs, torch.Generator().manual_seed(0))}
    print(f"seq {a.seq}, batch {a.batch}, {a.docs} documents per packed row, hidden {a.hidden}, "
          f"{a.layers} layers, {torch.get_num_threads()} threads; median seconds per step")
    rows = {**block_steps(args, a.batch, a.seq, pos), "model step": model_steps(args, a.batch, a.seq, pos)}
    print(f"{'':12s} {'unpacked':>10s} {'packed':>10s} {'ratio':>7s}")
    for name, fns in rows.items():
        t = timed(fns, a.steps, a.warmup)
        print(f"{name:12s} {t['unpacked']:10.4f} {t['packed']:10.4f} {t['packed'] / t['unpacked']:7.3f}")


if __name__ == "__main__":
    main()
