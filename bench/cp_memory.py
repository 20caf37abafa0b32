"""Activation memory per rank under context parallelism: the debug Qwen3.5 model at a long sequence,
micro-batch 1, under ``single``, ``cp2`` and ``cp4`` (one thread per rank), through the real CLI.

Prints, per layout, the per-step peak resident memory of rank 0 (``peak_mem_mb`` in metrics.jsonl:
the step's RSS high-water mark, after the first step; it includes the interpreter and the weights,
a few hundred MB that every layout pays alike, so the differences are the activations).

    python bench/cp_memory.py --seq 4096 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run(layout: str, seq: int, steps: int, root: Path) -> dict:
    run_dir = root / layout
    # "cpN": context parallel over N ranks (parallel.cp=N on the cp2 preset)
    par = [f"parallel={layout}"] if not layout.startswith("cp") else [
        "parallel=cp2", f"parallel.cp={layout[2:]}", f"parallel.world_size={layout[2:]}"]
    args = [sys.executable, "-m", "hyperpar", *par, f"train.seq_len={seq}", "train.micro_batch_size=1",
            f"train.global_batch_size={1}", f"train.steps={steps}", "launch.threads_per_rank=1",
            "metrics.progress_bar=false", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HYPERPAR_NO_BAR": "1"}
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=root)
    if res.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{res.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_mem_mb"] for r in records[1:] if r.get("peak_mem_mb") is not None] or [records[-1]["peak_mem_mb"]]
    return {"peak_mem_mb": max(peaks), "step_time_s": records[-1]["step_time_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", default="single,cp2,cp4")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {lay: run(lay, a.seq, a.steps, Path(tmp)) for lay in a.layouts.split(",")}
    base = rows.get("single")
    print(f"debug qwen3_5, seq {a.seq}, micro-batch 1, 1 thread per rank: rank 0's per-step peak RSS")
    print(f"{'layout':8s} {'peak MB':>9s} {'vs single':>10s} {'step s':>8s}")
    for lay, r in rows.items():
        ratio = r["peak_mem_mb"] / base["peak_mem_mb"] if base else float("nan")
        print(f"{lay:8s} {r['peak_mem_mb']:9.1f} {ratio:10.2f} {r['step_time_s']:8.2f}")


if __name__ == "__main__":
    main()
