"""How long a worker's CUDA graph launches keep the GPU idle, from a step-profiler trace.

Reads the Chrome / Perfetto JSON that `HYBRIDSERVE_PROFILE_DIR` makes a worker write (worker_runtime/step_profiler.py)
and, per cudaGraphLaunch call, reports its host duration and the delay from the call's start to the first GPU
activity after it: when the two match, the GPU waits for the whole launch call before the graph's first kernel runs,
so the call's host time is added to every replayed step.

    python bench/system/trace_graph_launch.py TRACE.json [TRACE.json ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    """The trace's events (a .json or .json.gz file)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def graph_launch_stats(events: list[dict]) -> dict[str, float]:
    """Median / p90 host microseconds of cudaGraphLaunch, and the median start-to-first-GPU-activity delay."""
    launches = sorted((e for e in events if e.get("name") == "cudaGraphLaunch" and "dur" in e), key=lambda e: e["ts"])
    if not launches:
        raise ValueError("the trace has no cudaGraphLaunch calls: was the profiled window all eager steps?")
    gpu_starts = sorted(e["ts"] for e in events if e.get("cat") in GPU_CATEGORIES)
    host = sorted(float(e["dur"]) for e in launches)
    delays = []
    for launch in launches:
        i = bisect.bisect_left(gpu_starts, launch["ts"])
        if i < len(gpu_starts):
            delays.append(float(gpu_starts[i] - launch["ts"]))
    return {
        "launches": len(launches),
        "host_us_p50": round(statistics.median(host), 1),
        "host_us_p90": round(host[int(0.9 * (len(host) - 1))], 1),
        "first_gpu_activity_after_us_p50": round(statistics.median(delays), 1) if delays else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {str(path): graph_launch_stats(load_events(path)) for path in args.traces}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
