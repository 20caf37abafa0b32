"""What a user runs against what transformers runs: ``python -m hyperpar`` (the whole trainer: data,
objective, clipping, AdamW, metrics) on a Hugging Face checkpoint against transformers' own
training step (forward with labels, backward, AdamW) on the same checkpoint, one process each.

The checkpoint is built here (random weights, ``save_pretrained``) from PERF_NOTES' geometries.
Rounds alternate the two sides (order swapped every round) so background load hits both alike;
the first ``--warmup`` steps of every run are warm-up (compilation, first-touch of the optimizer state
and of the heap; a compiled step settles at its third). The matmul peaks are measured before the
first round and after every round, and the fastest is the peak (on a shared host one measurement can
read 30 % low, which would flatter the fractions). Prints the machine's fp32 / bf16 matmul peaks, each
side's median step time, tokens/s, fraction of the matmul peak reached in model FLOP/s (at the
median step, and at the fastest, which tells a slow code path from a busy host), peak RSS
per step, page faults per step on CPU (fresh memory faulted in: allocator churn), and the ratio
transformers / ours (> 1: ours is faster). With ``--fsdp`` it also times
``fsdp2`` (2 processes x threads/2) against ``single`` (same global batch): the FSDP overhead;
``--vocab-parallel`` adds ``fsdp2`` with the embedding and head sharded by vocabulary over its ranks.

    python bench/trainer_vs_transformers.py --config dense_small --dtype fp32
    python bench/trainer_vs_transformers.py --config dense_small --dtype bf16
    python bench/trainer_vs_transformers.py --config moe_small --dtype fp32
    python bench/trainer_vs_transformers.py --config dense_small --fsdp --no-transformers [--floor] [--vocab-parallel]
    python bench/trainer_vs_transformers.py --device cuda --dtype bf16 --batch 16   # one GPU

On ``--device cuda`` the peaks are cuBLAS's (fp32 without TF32, as the trainer runs by default) and
memory is the CUDA allocator's peak per step instead of the process's RSS.

Our trainer flushes subnormal floats to zero on CPU (``launch.flush_denormals``, default on);
``--transformers-ftz`` also times transformers with the same CPU mode, to tell that gain apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hyperpar.models.layers import cpu_matmul, onednn_gemm

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import COMMON, CONFIGS, is_moe  # noqa: E402  (the geometries, one place)


def _version(package: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def cuda_matmul_peak(dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """Best GFLOP/s of an n x n cuBLAS matmul on the current GPU."""
    a, b = (torch.randn(n, n, device="cuda").to(dtype) for _ in range(2))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n**3 / best / 1e9


def cpu_summary() -> str:
    """The CPU's model, its matmul instruction sets, and the GEMM paths ``auto`` picks on it."""
    from hyperpar import cpu_info

    name = cpu_info.field("model name") or platform.processor() or platform.machine()
    flags = cpu_matmul._cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags] or ["flags unknown"]
    fp32 = "oneDNN" if onednn_gemm.auto_choice() else "BLAS"
    bf16 = "native" if cpu_matmul.native_half_gemm(torch.bfloat16) else "fp32 GEMMs on the bf16 values"
    return f"{name} ({', '.join(isa)}); auto GEMM paths: fp32 {fp32}, bf16 {bf16}"


def matmul_peak(dtype: torch.dtype, threads: int, n: int = 2048, reps: int = 5, device: str = "cpu") -> float:
    """On CUDA: :func:`cuda_matmul_peak`. On CPU: Best GFLOP/s of an n x n matmul on ``threads`` threads, torch's ``mm`` or oneDNN's GEMM, whichever
    is faster (of a 512 one where the n one would take over a second: a CPU without 16-bit GEMM runs
    bf16 at ~1 GFLOP/s)."""
    if device == "cuda":
        return cuda_matmul_peak(dtype)
    torch.set_num_threads(threads)
    if n > 512:
        small = matmul_peak(dtype, threads, 512, reps=2, device=device)
        if 2 * n**3 / (small * 1e9) > 1.0:
            return small
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    # torch's mm (MKL on x86) and oneDNN's GEMM (which launch.cpu_gemm can use): the faster counts
    gemms = [lambda: a @ b]
    # oneDNN has no 16-bit GEMM on a CPU without AVX-512 (it refuses to build the primitive there)
    if onednn_gemm.available() and (dtype == torch.float32 or cpu_matmul._probe_half_gemm(dtype)):
        gemms.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for gemm in gemms:
        gemm()
        for _ in range(reps):
            t0 = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def save_checkpoint(config: str, out: Path) -> None:
    if is_moe(config):
        from transformers import Qwen3_5MoeForCausalLM as HFModel
        from transformers import Qwen3_5MoeTextConfig as HFConfig
        model_type = "qwen3_5_moe_text"
    else:
        from transformers import Qwen3_5ForCausalLM as HFModel
        from transformers import Qwen3_5TextConfig as HFConfig
        model_type = "qwen3_5_text"
    torch.manual_seed(0)
    HFModel(HFConfig(**{**COMMON, "model_type": model_type, **CONFIGS[config]})).save_pretrained(out)


# The transformers side, run in its own process (threads fixed before torch starts its pool).
THEIRS = r'''
import json, sys, time, torch
from hyperpar.device import resolve_device
ckpt, seq, batch, steps, dtype, moe, threads = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6] == "1", int(sys.argv[7])
device = sys.argv[9]
dev = resolve_device(device)  # its peak memory: the CUDA allocator's, or the process's RSS on CPU
torch.set_num_threads(threads)
if sys.argv[8] == "1":  # before the OpenMP pool starts: its threads copy the mode
    torch.set_flush_denormal(True)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).to(device).train()
opt_kw = {"fused": True} if device == "cuda" else {}  # what a GPU user of transformers would pick
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **opt_kw)
gen = torch.Generator().manual_seed(0)
extra = {"output_router_logits": True} if moe else {}
for step in range(steps):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    dev.reset_peak_memory()  # and, on CPU, the window of its page-fault count
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False, **extra).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.item()  # waits for the GPU's queue: the step is done
    print(json.dumps({"step": step + 1, "step_time_s": time.perf_counter() - t0, "peak_mem_mb": dev.peak_memory_mb(),
                      "page_faults": dev.page_faults(), "loss": loss}), flush=True)
'''


def run_theirs(ckpt: Path, a, steps: int, ftz: bool = False) -> list[dict]:
    res = subprocess.run([sys.executable, "-c", THEIRS, str(ckpt), str(a.seq), str(a.batch), str(steps), a.dtype,
                          "1" if is_moe(a.config) else "0", str(a.threads), "1" if ftz else "0", a.device],
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"transformers step failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def _ours_cmd(ckpt: Path, a, steps: int, layout: str, work: Path, extra: list[str], batch: int = 0,
              threads: int = 0) -> tuple[list[str], Path]:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    model = "qwen3_5_moe" if is_moe(a.config) else "qwen3_5"
    world = 2 if layout == "fsdp2" else 1
    batch, threads = batch or a.batch, threads or a.threads // world
    args = [f"model={model}", f"model.hf_path={ckpt}", f"parallel={layout}", f"train.steps={steps}",
            f"train.seq_len={a.seq}", f"train.global_batch_size={batch}",
            f"train.micro_batch_size={batch // world}", f"launch.threads_per_rank={threads}",
            "train.max_grad_norm=1.0", "checkpoint=none", f"hydra.run.dir={run_dir}", f"device={a.device}",
            *(["train.mixed_precision.param_dtype=bfloat16"] if a.dtype == "bf16" else []), *extra]
    return [sys.executable, "-m", "hyperpar", *args], run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


LAST_RUN_DIR: dict[str, Path] = {}  # layout (or run_ours' key) -> its last run's directory (--profile reads it)


def run_ours(ckpt: Path, a, steps: int, layout: str, work: Path, extra: list[str],
             key: str | None = None) -> tuple[list[dict], float]:
    """Per-step records of ``python -m hyperpar`` and the time from its start to its first step.
    With ``--profile`` the run has one more step, profiled, left out of the records. ``key``: the
    name ``print_profile`` finds the run under (default: the layout)."""
    # shapes recorded (the GEMM rows of print_profile), and enough rows to hold every GEMM shape
    profiled = ([f"profile.steps=[{steps + 1}]", "profile.trace=false", "profile.row_limit=80",
                 "profile.record_shapes=true"] if a.profile else [])
    cmd, run_dir = _ours_cmd(ckpt, a, steps + 1 if a.profile else steps, layout, work, [*extra, *profiled])
    LAST_RUN_DIR[key or layout] = run_dir
    env = {**os.environ, "HYPERPAR_NO_BAR": "1"}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"hyperpar {layout} failed:\n{res.stderr[-3000:]}")
    recs = _records(run_dir)
    start = wall - sum(r["step_time_s"] for r in recs)
    return recs[:steps], start


def gemm_flops(op: str, shapes: list) -> float | None:
    """FLOPs of one call of a leaf GEMM operator from its recorded input shapes, None for any other
    op. Leaves only: the composite GEMM ops (``hyperpar::onednn_gemm``, ``aten::_grouped_mm`` and
    ``hyperpar::expert_loop_mm`` on a CPU) run these underneath, so counting them too would count
    their FLOPs twice."""
    try:
        if op == "aten::mm":  # (M, K) @ (K, N)
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2.0 * m * k * n
        if op in ("aten::addmm", "aten::addmm_"):  # bias / accumulator, (M, K), (K, N)
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2.0 * m * k * n
        if op == "aten::bmm":  # (B, M, K) @ (B, K, N)
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2.0 * b * m * k * n
        if op == "aten::baddbmm":  # (B, M, N) + (B, M, K) @ (B, K, N)
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return 2.0 * b * m * k * n
        if op == "mkldnn::_linear_pointwise":  # oneDNN's GEMM (launch.cpu_gemm): x (M, K) by w (N, K)
            (m, k), (n, _) = shapes[0], shapes[1]
            return 2.0 * m * k * n
    except (TypeError, ValueError, IndexError):
        return None
    return None


def print_profile(name: str, layout: str, peak: float) -> None:
    """The profiled extra step of ``layout``'s last run, per rank: phases, FSDP and collectives, top
    ops, and the GEMMs' share: their time and rate (from the recorded shapes) against ``peak``, the
    matmul peak of one rank's threads, and what the rest of the step took."""
    from hyperpar.profile_report import load_profiles, mean_over_ranks

    run_dir = LAST_RUN_DIR.get(layout)
    for d in (d for ranks in load_profiles(run_dir).values() for d in ranks) if run_dir else []:
        spent = ", ".join(f"{k} {v:.3f}" for k, v in d["phases_s"].items())
        dist = f"; fsdp hooks {d['fsdp_hooks_s']:.3f}, collectives {d['collectives_s']:.3f}" if d["fsdp_hooks_s"] else ""
        print(f"{name:>14}: profiled step {d['step']} rank {d['rank']} ({d['step_time_s']:.3f} s under the profiler): "
              f"{spent} s{dist}")
        ops = mean_over_ranks([d])  # rows are split by shape: summed per operator (compiled graphs one bucket)
        top = sorted(ops["ops_s"].items(), key=lambda kv: -kv[1])[:6]
        print(" " * 16 + "top ops (self s, calls): " + ", ".join(
            f"{n[:40]} {t:.3f} ({ops['calls'][n]:.0f})" for n, t in top))
        gemm_s = gemm_flop = 0.0
        for o in d["top_ops"]:
            f = gemm_flops(o["name"], o.get("input_shapes") or [])
            if f is not None:
                gemm_s += o["self_s"]
                gemm_flop += f * o["count"]
        if gemm_s:
            rate = gemm_flop / gemm_s / 1e9
            print(" " * 16 + f"GEMMs: {gemm_s:.3f} s for {gemm_flop / 1e12:.3f} TFLOP, {rate:.0f} GFLOP/s "
                  f"({rate / peak:.2f} of this rank's peak, {peak:.0f}); the rest of the step "
                  f"{d['step_time_s'] - gemm_s:.3f} s")


def run_floor(ckpt: Path, a, steps: int, work: Path, extra: list[str]) -> tuple[list[dict], None]:
    """fsdp2's floor: two independent ``single`` runs at once, threads/2 and half the batch each, with
    no communication at all. A step counts as the slower of the two (ranks of one job wait for it)."""
    env = {**os.environ, "HYPERPAR_NO_BAR": "1"}
    runs = [_ours_cmd(ckpt, a, steps, "single", work, extra, batch=a.batch // 2, threads=a.threads // 2) for _ in range(2)]
    cmds = [(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), run_dir)
            for cmd, run_dir in runs]
    for proc, _ in cmds:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"hyperpar single (floor) failed:\n{err[-3000:]}")
    pair = [_records(run_dir) for _, run_dir in cmds]
    return [max(x, y, key=lambda r: r["step_time_s"]) for x, y in zip(*pair)], None


def summary(name: str, recs: list[list[dict]], flops_per_step: float, peak: float, warmup: int,
            mem_label: str = "peak RSS/step") -> dict:
    times = [r["step_time_s"] for run in recs for r in run[warmup:]]
    mem = [r.get("peak_mem_mb") or 0.0 for run in recs for r in run[warmup:]]
    med = statistics.median(times)
    faults = [r["page_faults"] for run in recs for r in run[warmup:] if r.get("page_faults") is not None]
    row = {"median_s": med, "min_s": min(times), "tokens_per_s": None, "peak_frac": flops_per_step / med / 1e9 / peak,
           "peak_frac_fastest": flops_per_step / min(times) / 1e9 / peak,
           "peak_mem_mb": max(mem), "page_faults": statistics.median(faults) if faults else None}
    # page faults: fresh memory faulted in during the step (allocator churn; CPU only)
    churn = f", page faults/step {row['page_faults']:.0f}" if row["page_faults"] is not None else ""
    print(f"{name:>14}: median step {med:.3f} s (min {min(times):.3f}, {len(times)} steps), "
          f"{row['peak_frac']:.2f} of the matmul peak ({row['peak_frac_fastest']:.2f} at the fastest step), {mem_label} {row['peak_mem_mb']:.0f} MB{churn}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="dense_small")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps at the start of every run left out of the figures")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="host threads per side (default: 2 on CPU, every core with --device cuda, as a GPU user runs)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU (the first visible)")
    ap.add_argument("--fsdp", action="store_true", help="also time fsdp2 (threads/2 each) against single")
    ap.add_argument("--floor", action="store_true",
                    help="with --fsdp: also time two independent single runs at once (threads/2, half the batch "
                         "each, no communication), the floor of fsdp2 against single on this machine")
    ap.add_argument("--vocab-parallel", action="store_true",
                    help="with --fsdp: also time fsdp2 with the embedding and head sharded by vocabulary over "
                         "its ranks (parallel.fsdp_vocab_parallel=true)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--transformers-ftz", action="store_true",
                    help="also time transformers with subnormals flushed to zero, as our trainer runs by default")
    ap.add_argument("--ours", nargs="*", default=[], help="extra overrides for our runs (e.g. train.compile=true)")
    ap.add_argument("--profile", action="store_true",
                    help="our runs take one more step, profiled (profile.steps) and left out of the figures; "
                         "the last round's phases and top operators are printed per rank (the launch-to-first-step "
                         "figure then includes writing the profile)")
    a = ap.parse_args()
    if a.threads is None:
        a.threads = (os.cpu_count() or 1) if a.device == "cuda" else 2
    if a.device == "cuda" and (a.fsdp or a.transformers_ftz):
        ap.error("--fsdp and --transformers-ftz compare CPU runs (--device cpu)")
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup {a.warmup} leaves no timed step of --steps {a.steps}")

    measured: dict[str, list[float]] = {"fp32": [], "bf16": []}

    def measure_peaks() -> None:
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            measured[name].append(matmul_peak(dt, a.threads, device=a.device))

    measure_peaks()
    where = f"{torch.cuda.get_device_name(0)}, " if a.device == "cuda" else ""
    where += f"{os.cpu_count()} cores, {a.threads} threads"
    print(f"machine: {where}; matmul peak fp32 {measured['fp32'][0]:.0f} GFLOP/s, "
          f"bf16 {measured['bf16'][0]:.0f} GFLOP/s (measured again after every round)")
    if a.device == "cpu":  # which host type, and the CPU GEMM paths our trainer takes by default on it
        print(f"cpu: {cpu_summary()}")
    # the baseline is whatever transformers release is installed: say which
    print(f"versions: torch {torch.__version__}, transformers {_version('transformers')}, "
          f"hyperpar {_version('hyperpar')}")
    work = Path(tempfile.mkdtemp(prefix="hyperpar-bench-"))
    ckpt = work / "ckpt"
    save_checkpoint(a.config, ckpt)

    from hyperpar.models.qwen3_5 import Qwen3_5Args
    from hyperpar.models.qwen3_5_moe import Qwen3_5MoeArgs
    args = (Qwen3_5MoeArgs if is_moe(a.config) else Qwen3_5Args).from_hf_config({**COMMON, **CONFIGS[a.config]})
    with torch.device("meta"):
        from hyperpar.models.qwen3_5 import Qwen3_5ForCausalLM
        from hyperpar.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
        meta = (Qwen3_5MoeForCausalLM if is_moe(a.config) else Qwen3_5ForCausalLM)(args)
    flops_per_step = meta.flops_per_token(a.seq) * a.seq * a.batch
    print(f"config {a.config}, {a.dtype}, seq {a.seq} x batch {a.batch}, {flops_per_step / 1e12:.2f} TFLOP per step "
          f"(model FLOPs), {a.rounds} rounds x {a.steps} steps per side ({a.warmup} warm-up)")

    if a.dtype == "bf16" and not a.no_transformers and measured["bf16"][0] < 0.1 * measured["fp32"][0]:
        # no bf16 GEMM here (x86 without AVX-512): transformers' bf16 step takes torch's fallbacks
        print(f"note: this CPU's bf16 GEMM runs at {measured['bf16'][0]:.0f} GFLOP/s, so transformers' bf16 step "
              "takes minutes (dense_small: 244 s a step on a 2-core AVX2 EPYC); --no-transformers times ours alone")
    sides = {"ours": lambda: run_ours(ckpt, a, a.steps, "single", work, a.ours)}
    if not a.no_transformers:
        sides["transformers"] = lambda: (run_theirs(ckpt, a, a.steps), None)
        if a.transformers_ftz:
            sides["transformers ftz"] = lambda: (run_theirs(ckpt, a, a.steps, ftz=True), None)
    if a.fsdp:
        sides["ours fsdp2"] = lambda: run_ours(ckpt, a, a.steps, "fsdp2", work, a.ours)
        if a.vocab_parallel:
            sides["fsdp2 vocab"] = lambda: run_ours(ckpt, a, a.steps, "fsdp2", work,
                                                   [*a.ours, "parallel.fsdp_vocab_parallel=true"], key="fsdp2 vocab")
        if a.floor:
            sides["2 x single"] = lambda: run_floor(ckpt, a, a.steps, work, a.ours)
    recs: dict[str, list] = {k: [] for k in sides}
    startup: dict[str, list] = {k: [] for k in sides}
    order = list(sides)
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            run, start = sides[name]()
            recs[name].append(run)
            if start is not None:
                startup[name].append(start)
        measure_peaks()
    peaks = {k: max(v) for k, v in measured.items()}
    print(f"matmul peak: fp32 {peaks['fp32']:.0f} GFLOP/s (fastest of {len(measured['fp32'])}, slowest "
          f"{min(measured['fp32']):.0f}), bf16 {peaks['bf16']:.0f} (slowest {min(measured['bf16']):.0f})")
    # Against the machine's fastest GEMM: on a CPU without bf16 GEMM that is fp32's (which our bf16
    # step uses there, train.mixed_precision.cpu_matmul), elsewhere bf16's.
    peak = max(peaks[a.dtype], peaks["fp32"])
    mem_label = "peak GPU memory/step" if a.device == "cuda" else "peak RSS/step"
    rows = {k: summary(k, v, flops_per_step, peak, a.warmup, mem_label) for k, v in recs.items()}
    for k, v in startup.items():
        if v:
            print(f"{k:>14}: launch to first step {statistics.median(v):.1f} s (process start, model load, first batch)")
    if "transformers" in rows:
        print(f"ratio transformers / ours ({a.dtype}, {a.config}): {rows['transformers']['median_s'] / rows['ours']['median_s']:.2f}x; "
              f"{mem_label} ours {rows['ours']['peak_mem_mb']:.0f} MB vs transformers {rows['transformers']['peak_mem_mb']:.0f} MB")
    if "transformers ftz" in rows:
        print(f"ratio transformers (flush-to-zero) / ours: {rows['transformers ftz']['median_s'] / rows['ours']['median_s']:.2f}x")
    if a.profile:
        print_profile("ours", "single", peak)
        if a.fsdp:  # a rank runs threads/2 of the threads the peak was measured on
            print_profile("ours fsdp2", "fsdp2", peak / 2)
        if a.vocab_parallel:
            print_profile("fsdp2 vocab", "fsdp2 vocab", peak / 2)
    if "ours fsdp2" in rows:
        print(f"fsdp2 / single step time: {rows['ours fsdp2']['median_s'] / rows['ours']['median_s']:.3f}x")
    if "fsdp2 vocab" in rows:
        print(f"fsdp2 with parallel.fsdp_vocab_parallel / single step time: "
              f"{rows['fsdp2 vocab']['median_s'] / rows['ours']['median_s']:.3f}x")
    if "2 x single" in rows:
        print(f"floor (2 x single, no communication) / single step time: "
              f"{rows['2 x single']['median_s'] / rows['ours']['median_s']:.3f}x")


if __name__ == "__main__":
    main()
