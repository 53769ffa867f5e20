"""bench/system/first_request.py runs on CPU (the demo model): every gap gets its samples, in the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import first_request

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo_model"


def test_first_request_bench_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "first.json"
    assert first_request.main(["--model", str(DEMO), "--input-len", "40", "--gaps", "0,0.01",
                               "--repeats", "2", "--max-model-len", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["by_gap"]) == {"0", "0.01"} and result["first_after_start_ms"] > 0
    assert all(len(g["samples"]) == 2 and g["ttft_ms_median"] > 0 for g in result["by_gap"].values())
