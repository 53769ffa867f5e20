"""bench/moe.py smoke-runs on the CPU (tiny shapes, same code path as on the GPU) and writes every section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "moe.py"


def test_moe_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["tiny"] and result["ceilings"]["copy_GBps"] > 0
    for section in ("layer", "fp8"):
        rows = result[section]
        assert isinstance(rows, list), rows
        assert {r["phase"] for r in rows} == {"decode", "prefill"}
        assert all(r["layer_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
        assert all(r["shared_fused"] == (section == "layer") for r in rows)  # fp8 experts keep the shared MLP apart
    assert result["step"]["graph_ms"] > 0 and result["step"]["floor_ms"] > 0
