"""bench/system/trace_graph_launch.py: graph launch host time and the GPU's wait for it, from a step-profiler trace."""

from __future__ import annotations

import gzip
import json

import pytest
from trace_graph_launch import graph_launch_stats, load_events


def _trace(launches: list[tuple[float, float]], kernel_delay: float) -> list[dict]:
    events: list[dict] = []
    for ts, dur in launches:
        events.append({"name": "cudaGraphLaunch", "ph": "X", "ts": ts, "dur": dur, "cat": "cuda_runtime"})
        events.append({"name": "_skinny_linear_kernel", "ph": "X", "ts": ts + kernel_delay, "dur": 40.0, "cat": "kernel"})
    return events


def test_a_launch_the_gpu_waits_for_is_reported_with_its_delay(tmp_path) -> None:
    events = _trace([(1000.0 * i, 250.0 + i) for i in range(5)], kernel_delay=260.0)
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    stats = graph_launch_stats(load_events(path))
    assert stats["launches"] == 5
    assert stats["host_us_p50"] == 252.0 and stats["host_us_p90"] == 253.0
    assert stats["first_gpu_activity_after_us_p50"] == 260.0


def test_a_trace_without_graph_launches_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no cudaGraphLaunch"):
        graph_launch_stats([{"name": "aten::mm", "ph": "X", "ts": 0.0, "dur": 1.0}])
