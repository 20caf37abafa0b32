"""The chunked gated delta rule alone: forward + backward of one layer, per chunk size, eager and
compiled (``train.compile``'s graph), on CPU or one GPU. What ``gated_deltanet.default_chunk_size``
is chosen from: on CPU the C² intra-chunk work decides, on a GPU the count of per-chunk launches.

    python bench/delta_rule.py                       # CPU, 2 threads, dense_small's heads, 2 x 1024
    python bench/delta_rule.py --device cuda --batch 8

Prints the median and fastest of ``--reps`` timed calls per case (after ``--warmup``), and the
model FLOP/s the rule reaches by the trainer's FLOP count of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hyperpar.models.layers.gated_deltanet import chunk_gated_delta_rule, default_chunk_size, delta_rule_macs_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", default="4,8", help="key heads, value heads (dense_small: 4,8)")
    ap.add_argument("--dims", default="64,64", help="key head dim, value head dim")
    ap.add_argument("--chunks", default="16,32,64")
    ap.add_argument("--threads", type=int, default=2, help="host threads on CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
        torch.set_flush_denormal(True)  # as the trainer runs (launch.flush_denormals)
    nk, nv = (int(x) for x in a.heads.split(","))
    dk, dv = (int(x) for x in a.dims.split(","))
    B, S = a.batch, a.seq
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, nk, dk, generator=gen).to(dev).requires_grad_() for _ in range(2))
    v = torch.randn(B, S, nv, dv, generator=gen).to(dev).requires_grad_()
    gate = (-torch.rand(B, S, nv, generator=gen) * 2).to(dev).requires_grad_()
    beta = torch.rand(B, S, nv, generator=gen).to(dev).requires_grad_()
    dy = torch.randn(B, S, nv, dv, generator=gen).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    flops = 6 * B * S * delta_rule_macs_per_token(nv, dk, dv)  # the trainer's count, forward + backward
    print(f"device {dev}, B {B}, S {S}, heads {nk}/{nv}, dims {dk}/{dv}; default chunk here: "
          f"{default_chunk_size(dev)}")
    modes = [("eager", chunk_gated_delta_rule)]
    if not a.no_compile:
        modes.append(("compiled", torch.compile(chunk_gated_delta_rule, dynamic=False)))
    for name, fn in modes:
        for C in (int(c) for c in a.chunks.split(",")):
            for _ in range(a.warmup):
                fn(q, k, v, gate, beta, C).backward(dy)
            sync()
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                fn(q, k, v, gate, beta, C).backward(dy)
                sync()
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            print(f"{name:8s} chunk {C:3d}: median {med * 1e3:8.2f} ms, fastest {min(times) * 1e3:8.2f} ms, "
                  f"{flops / med / 1e9:7.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
