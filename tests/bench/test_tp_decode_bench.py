"""bench/tp_decode.py runs end to end on CPU with a tiny checkpoint (gloo, TP=1 and TP=2) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import nemotron_h

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tp_decode.py"


def test_tp_decode_smoke(tmp_path: Path) -> None:
    model_dir, _ = nemotron_h("M*-M")
    out = tmp_path / "tp.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(model_dir), "--device", "cpu", "--dtype", "float32",
         "--steps", "2", "--batch", "1", "2", "--agreement", "24", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["tp"], r["batch"]) for r in result["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in result["rows"])
    assert result["top1_agreement"] == 1.0  # fp32, same dummy weights sliced
