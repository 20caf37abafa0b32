"""Context parallel (Ulysses) kernel wrappers: the attention core and the GatedDeltaNet recurrence
(conv + chunked delta rule) under cp 2, each rank holding a sequence shard, equal the full-sequence
kernels on one process, forward and backward, with grouped K/V (and key) heads fewer than cp
repeated, and with packed documents."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

CP = 2
B, S = 2, 48  # GDN chunk 16: three chunks over the full row, documents crossing the shard edge


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _inputs(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _documents():
    from hyperpar.models.layers.documents import Documents

    pos = torch.cat([torch.arange(20), torch.arange(28)]).unsqueeze(0).repeat(B, 1)  # row: documents 20 + 28
    pos[1] = torch.cat([torch.arange(7), torch.arange(41)])
    return Documents.from_positions(pos)


def _compare(run, build_args, names: list[str], rank: int, group) -> dict[str, float]:
    """Reference: ``run(False, ...)`` (the plain kernel) on full tensors. CP: ``run(True, ...)`` (the
    wrapped one) on this rank's sequence shard (seq dim 1) of the tensors in ``names``; the rest
    (weights) passed whole."""
    import torch.distributed as dist

    full = build_args()
    ref_in = {n: t.clone().requires_grad_() for n, t in full.items()}
    ref = run(False, *ref_in.values())
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(99))
    (ref * w).sum().backward()

    s = S // CP
    cp_in = {n: (t[:, rank * s:(rank + 1) * s] if n in names else t).clone().requires_grad_() for n, t in full.items()}
    out = run(True, *cp_in.values())
    (out * w[:, rank * s:(rank + 1) * s]).sum().backward()
    report = {"out": _rel(out, ref[:, rank * s:(rank + 1) * s]), "shape_ok": float(out.shape == w[:, :s].shape)}
    for n in full:
        g = cp_in[n].grad
        if n in names:
            report[f"grad_{n}"] = _rel(g, ref_in[n].grad[:, rank * s:(rank + 1) * s])
        else:  # a weight: every rank's share sums to the full gradient
            g = g.clone()
            dist.all_reduce(g, group=group)
            report[f"grad_{n}"] = _rel(g, ref_in[n].grad)
    return report


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperpar.distributed.context_parallel import UlyssesAttention, UlyssesDeltaRule
    from hyperpar.models.layers.attention import AttentionCore
    from hyperpar.models.layers.gated_deltanet import GatedDeltaRule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        group = mesh.get_group()
        doc = _documents()
        reports = {}
        for kv in (1, 2, 4):  # fewer KV heads than cp (repeated), as many, more
            for packed in (False, True):
                cores = {False: AttentionCore(scale=0.125), True: UlyssesAttention(mesh).apply(AttentionCore(scale=0.125))}
                d = doc if packed else None

                def attn(wrapped, q, k, v, cores=cores, d=d):
                    return cores[wrapped](q, k, v, doc=d)

                shapes = {"q": (B, S, 4, 8), "k": (B, S, kv, 8), "v": (B, S, kv, 8)}
                reports[f"attn_kv{kv}_doc{packed}"] = _compare(attn, lambda: _inputs(shapes, kv), list(shapes), rank, group)
        for nk in (1, 2):  # key heads fewer than cp (repeated, conv weights too), as many
            nv, dk, dv, K = 4, 8, 8, 4
            for packed in (False, True):
                rules = {False: GatedDeltaRule(chunk_size=16), True: UlyssesDeltaRule(mesh).apply(GatedDeltaRule(chunk_size=16))}
                d = doc if packed else None

                def gdn(wrapped, q, k, v, g, beta, cq, ck, cv, rules=rules, d=d):
                    return rules[wrapped](q, k, v, -torch.nn.functional.softplus(g), torch.sigmoid(beta), cq, ck, cv, doc=d)

                shapes = {"q": (B, S, nk, dk), "k": (B, S, nk, dk), "v": (B, S, nv, dv), "g": (B, S, nv),
                          "beta": (B, S, nv), "cq": (nk * dk, 1, K), "ck": (nk * dk, 1, K), "cv": (nv * dv, 1, K)}
                reports[f"gdn_nk{nk}_doc{packed}"] = _compare(gdn, lambda: _inputs(shapes, 10 + nk), list(shapes)[:5],
                                                              rank, group)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def test_ulysses_kernels_under_cp2_equal_full_sequence(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(CP, _free_port(), str(tmp_path)), nprocs=CP, join=True)
    for r in range(CP):
        reports = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(reports) == 10
        for case, rep in reports.items():
            assert rep.pop("shape_ok") == 1.0, case
            assert all(v <= 1e-5 for v in rep.values()), (case, rep)
