"""bench/kernels/moe.py smoke-runs on the CPU (tiny shapes, same code path as on the GPU) and writes every section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "kernels" / "moe.py"


def test_moe_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["tiny"] and result["ceilings"]["copy_GBps"] > 0
    for section in ("decode", "fp8_decode"):
        rows = result[section]
        assert isinstance(rows, list) and [r["tokens"] for r in rows] == [1, 4], rows
        for path in ("grouped", "small", "default"):
            assert all(r[f"{path}_ms"] > 0 and r[f"{path}_over_floor"] > 0 for r in rows)
        assert all(r["shared_fused"] == (section == "decode") for r in rows)  # fp8 experts keep the shared MLP apart
    for section in ("prefill", "fp8_prefill"):  # one row per --prefill-tokens count
        assert [r["tokens"] for r in result[section]] == [64], result[section]
        assert all(r["experts_TFLOPs"] > 0 and r["same_shape_mm_TFLOPs"] > 0 for r in result[section])
    assert result["step"]["graph_ms"] > 0 and result["step"]["graph_grouped_only_ms"] > 0
    assert result["step"]["floor_ms"] > 0
    assert any(line.startswith("step batch 1") for line in result["summary"])
