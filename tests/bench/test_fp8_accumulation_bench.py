"""bench/kernels/fp8_accumulation.py smoke-runs on the CPU (tiny shapes, the Triton interpreter): both accumulation
modes of the W8A8 grouped GEMM equal the fp32 product of the dequantized operands, and fp8 quantization's own error
is recorded beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "kernels" / "fp8_accumulation.py"


def test_fp8_accumulation_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "fp8_accumulation.json"
    done = subprocess.run([sys.executable, str(BENCH), "--tiny", "--tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["gemm"]) for r in rows] == [(8, "up"), (8, "down")]
    for row in rows:
        for mode in ("fast", "precise"):  # the interpreter multiplies exactly: only fp32 rounding is left
            assert row[mode]["ms"] > 0 and row[mode]["rel_rms"] < 1e-5, row
        assert 1e-3 < row["quant_err"]["rel_rms"] < 0.2, row  # e4m3 keeps 3 mantissa bits
