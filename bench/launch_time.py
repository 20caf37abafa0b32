"""Launch overhead: seconds from ``python -m hyperpar`` to the first step's line, to the "done"
line, and to the end of the process (what a caller reading the run's output to its end waits for),
per layout, on the tiny debug model (a few steps: the figures are startup and exit, not training).

    python bench/launch_time.py                      # single, fsdp2, fsdp4; 3 rounds
    python bench/launch_time.py --layouts fsdp2,fsdp2_tp2_pp2 --rounds 2

Layouts alternate within a round, so background load hits them alike; medians are printed, with
each job's final loss (the same for every layout of the same global batch). Run it from a scratch
directory: each job writes its run dir under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_run(layout: str, steps: int, out: Path, extra: list[str]) -> tuple[float, float, float, str]:
    run_dir = out / layout
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "hyperpar", f"parallel={layout}", "train.seq_len=16", "train.global_batch_size=8",
           "train.micro_batch_size=1", "launch.threads_per_rank=1", f"train.steps={steps}", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "HYPERPAR_NO_BAR": "1"}
    t0 = time.perf_counter()
    first = done = None
    loss = "?"
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) as p:
        for line in p.stderr:
            tail = (tail + [line])[-20:]
            if first is None and "step 1 loss" in line:
                first = time.perf_counter()
            if "done:" in line:
                done = time.perf_counter()
                loss = line.split("final loss ")[-1].split(";")[0]
        p.wait()
    end = time.perf_counter()
    if p.returncode != 0 or first is None or done is None:
        raise SystemExit(f"{layout}: the run failed (exit {p.returncode}):\n{''.join(tail)}")
    return first - t0, done - t0, end - t0, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="single,fsdp2,fsdp4", help="comma-separated parallel= layouts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("launch_time_runs"))
    ap.add_argument("overrides", nargs="*", help="more CLI overrides for every job")
    args = ap.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    times: dict[str, list[tuple[float, float, float, str]]] = {x: [] for x in layouts}
    for r in range(args.rounds):
        for layout in layouts:
            got = one_run(layout, args.steps, args.out, args.overrides)
            times[layout].append(got)
            print(f"round {r + 1} {layout:16s} first step {got[0]:6.2f} s  done {got[1]:6.2f} s  "
                  f"exit {got[2]:6.2f} s  loss {got[3]}", flush=True)
    print(f"\nmedians over {args.rounds} round(s), {args.steps} steps, {os.cpu_count()} CPUs")
    print(f"{'layout':16s} {'first step':>10s} {'done':>8s} {'exit':>8s} {'exit - done':>12s}")
    for layout, rows in times.items():
        med = [statistics.median(row[i] for row in rows) for i in range(3)]
        print(f"{layout:16s} {med[0]:10.2f} {med[1]:8.2f} {med[2]:8.2f} {med[2] - med[1]:12.2f}")


if __name__ == "__main__":
    main()
