"""bench/system/mixed_step.py --host-time runs on CPU with the demo model: every mode's step is timed and the GC pauses and
thread CPU times are recorded per step (so the GPU measurement does not rot between device sessions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mixed_step
import pytest

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo_model"


def test_host_time_records_every_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["mixed_step.py", "--host-time", "--model", str(DEMO), "--repeats", "2",
                                      "--decode-rows", "2", "--prompt-len", "32", "--timeline-lens", "0,32",
                                      "--out", str(tmp_path)])
    mixed_step.main()
    rows = json.loads((tmp_path / "mixed_step_host.json").read_text())
    assert {(r["prefill_tokens"], r["mode"]) for r in rows} == {(n, m) for n in (0, 32) for m in ("whole",)}
    for row in rows:
        assert len(row["host_ms"]) == len(row["thread_cpu_ms"]) == len(row["gc_pause_ms"]) >= 1
        assert all(g >= 0 for g in row["gc_pause_ms"])
