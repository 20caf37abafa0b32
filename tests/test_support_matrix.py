"""The support matrix page is generated from parity reports: one row per family, one column per layout."""

from __future__ import annotations

import json
from pathlib import Path

from hyperpar.parity.matrix import collect, main, render


def _sweep(root: Path, model: str, jobs: list[tuple[str, float | None, bool]]) -> Path:
    sweep = root / model
    rows = []
    for i, (layout, diff, passed) in enumerate(jobs):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text(f"model:\n  name: {model}\nparallel:\n  name: {layout}\n")
        rows.append({"name": f"parallel={layout}", "parallel": layout, "path": str(job), "is_baseline": i == 0,
                     "status": "completed", "max_step_diff": diff, "passed": passed, "error": None})
    (sweep / "parity.json").write_text(json.dumps({"tolerance_step": 1e-5, "jobs": rows}))
    return sweep


def test_matrix_from_reports(tmp_path: Path) -> None:
    a = _sweep(tmp_path, "qwen3_5", [("single", None, True), ("tp2", 1.4e-6, True), ("fsdp_tp2", 3e-5, False)])
    b = _sweep(tmp_path, "qwen3_vl_moe", [("single", None, True), ("ep2", 9.5e-7, True)])
    text = render(collect([a, b]), [("`parallel.pp` > 1", "not built yet")])
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("| family"))
    assert header == "| family | `single` | `tp2` | `fsdp_tp2` | `ep2` |"
    assert "| `qwen3_5` | baseline | ✓ 1.4e-06 | ✗ 3.0e-05 | — |" in lines
    assert "| `qwen3_vl_moe` | baseline | — | — | ✓ 9.5e-07 |" in lines
    assert "| `parallel.pp` > 1 | not built yet |" in lines
    out = tmp_path / "matrix.md"
    assert main([str(a), str(b), "--out", str(out)]) == 0 and out.read_text().startswith("# Support matrix")
    assert main([str(tmp_path / "nowhere")]) == 2
