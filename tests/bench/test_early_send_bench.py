"""bench/early_send_ttft.py on the CPU (tiny dummy model, four worker processes): every mode answers and the
JSON has a row per prompt length with TTFT medians for local prefill, the late, chunk-only and layer-wise gRPC
send."""

from __future__ import annotations

import json
from pathlib import Path

import early_send_ttft


def test_early_send_ttft_smoke(tmp_path: Path) -> None:
    out = tmp_path / "early_send_ttft.json"
    assert early_send_ttft.main(["--device", "cpu", "--tokens", "192", "--runs", "1", "--prefill-chunk-size", "64",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["prefill_chunk_tokens"] == 64
    (row,) = result["rows"]
    assert row["tokens"] == 192
    assert all(row[f"ttft_ms_{mode}"] > 0 for mode in ("local", "late", "chunks", "early"))
    assert "gain_ms" in row and "layer_gain_ms" in row
