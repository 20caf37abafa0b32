"""Training-step throughput: hyperpar's Qwen3.5 / Qwen3.5-MoE vs transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM, same config and weights.

One step = forward, cross-entropy, backward, AdamW step. Ours uses pre-shifted labels and
``F.cross_entropy`` (what the trainer does), plus the returned ``aux_loss`` for MoE; transformers
gets ``labels=input_ids`` (and ``output_router_logits=True`` for MoE, so its loss carries the same
aux term) and shifts inside. Its experts run its default ``grouped_mm`` path. Steps alternate between
the two implementations (order swapped every step) so background load hits both alike; medians are
reported.

    python bench/train_throughput.py --config dense_small --seq 1024 --batch 2 --steps 6
    python bench/train_throughput.py --config moe_small --seq 1024 --batch 2 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

CONFIGS: dict[str, dict] = {
    "debug": dict(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
    ),
    # PERF_NOTES.md's "dense_small": hidden 512, 8 layers (L L L F) x 2, vocab 32000, I 1536.
    "dense_small": dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
    ),
}
# PERF_NOTES.md's 8-expert top-2 MoE variant of dense_small (k·Ie + Is = I of the dense model).
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            router_aux_loss_coef=0.001)
CONFIGS["moe_debug"] = {**{k: v for k, v in CONFIGS["debug"].items() if k != "intermediate_size"},
                        **_MOE, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 64}
CONFIGS["moe_small"] = {**{k: v for k, v in CONFIGS["dense_small"].items() if k != "intermediate_size"}, **_MOE}
COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
              max_position_embeddings=32768, use_cache=False)


def is_moe(config: str) -> bool:
    return "num_experts" in CONFIGS[config]


def build(config: str, dtype: torch.dtype):
    if is_moe(config):
        from transformers import Qwen3_5MoeForCausalLM as HFModel
        from transformers import Qwen3_5MoeTextConfig as HFConfig

        from hyperpar.models.qwen3_5_moe import Qwen3_5MoeArgs as Args
        from hyperpar.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as Model
        from hyperpar.models.qwen3_5_moe import Qwen3_5MoeStateDictAdapter as Adapter

        model_type = "qwen3_5_moe_text"
    else:
        from transformers import Qwen3_5ForCausalLM as HFModel
        from transformers import Qwen3_5TextConfig as HFConfig

        from hyperpar.models.qwen3_5 import Qwen3_5Args as Args
        from hyperpar.models.qwen3_5 import Qwen3_5ForCausalLM as Model
        from hyperpar.models.qwen3_5 import Qwen3_5StateDictAdapter as Adapter

        model_type = "qwen3_5_text"
    cfg = {**COMMON, "model_type": model_type, **CONFIGS[config]}
    torch.manual_seed(0)
    theirs = HFModel(HFConfig(**cfg)).to(dtype).train()
    args = Args.from_hf_config(cfg)
    with torch.device("meta"):
        ours = Model(args)
    ours.to_empty(device="cpu")
    ours.init_buffers()
    adapter = Adapter(args)
    sd = theirs.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(adapter.load_param(name, sd.__getitem__))
    ours.to(dtype).train()
    return ours, theirs, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="dense_small")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16

    ours, theirs, args = build(a.config, dtype)
    n_params = sum(p.numel() for p in ours.parameters())
    ffn = (f"E/k/Ie/Is {args.num_experts}/{args.num_experts_per_tok}/{args.moe_intermediate_size}/"
           f"{args.shared_expert_intermediate_size}" if is_moe(a.config) else f"I {args.intermediate_size}")
    print(
        f"config {a.config}: hidden {args.hidden_size}, layers {args.num_hidden_layers} "
        f"({args.num_full_layers} full), vocab {args.vocab_size}, {ffn}, "
        f"nh/nkv/hd {args.num_attention_heads}/{args.num_key_value_heads}/{args.head_dim}, "
        f"nk/nv/dk/dv {args.linear_num_key_heads}/{args.linear_num_value_heads}/"
        f"{args.linear_key_head_dim}/{args.linear_value_head_dim}, {n_params / 1e6:.1f}M params"
    )
    print(f"seq {a.seq} x batch {a.batch}, {a.dtype}, {a.threads} threads, {a.steps} steps each")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (a.batch, a.seq), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # pre-shifted: position t predicts token t+1
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-5)

    def step_ours() -> float:
        out = ours(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        if not isinstance(out, torch.Tensor) and out.aux_loss is not None:
            loss = loss + out.aux_loss
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return loss.item()

    def step_theirs() -> float:
        extra = {"output_router_logits": True} if is_moe(a.config) else {}
        loss = theirs(input_ids=ids, labels=ids, use_cache=False, **extra).loss
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        return loss.item()

    def timed(fn: Callable[[], float]) -> tuple[float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fn()
        return time.perf_counter() - t0, time.process_time() - c0, loss

    # Wall time is what counts; process CPU time is printed too because it is far less sensitive
    # to other jobs on a shared machine (with --threads 1 the two agree on a quiet machine).
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    cpu: dict[str, list[float]] = {"ours": [], "transformers": []}
    first_loss: dict[str, float] = {}
    runs = [("ours", step_ours), ("transformers", step_theirs)]
    for i in range(a.warmup + a.steps):
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            dt, dc, loss = timed(fn)
            first_loss.setdefault(name, loss)
            if i >= a.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    tokens = a.batch * a.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"first-step loss: ours {first_loss['ours']:.6f}  transformers {first_loss['transformers']:.6f}")
    for name in ("ours", "transformers"):
        print(
            f"{name:>12}: median step {med[name]:.3f} s  ({tokens / med[name]:.0f} tokens/s)  "
            f"min {min(times[name]):.3f} s  | CPU time median {med_cpu[name]:.3f} s min {min(cpu[name]):.3f} s"
        )
    print(f"speed ratio ours/transformers (tokens/s): {med['transformers'] / med['ours']:.3f}x")
    print(f"CPU-time ratio transformers/ours: {med_cpu['transformers'] / med_cpu['ours']:.3f}x")
    print(f"ours MFU-style rate: {ours.flops_per_token(a.seq) * tokens / med['ours'] / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
