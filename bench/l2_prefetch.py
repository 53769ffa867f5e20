"""How much an L2 prefetch of a decode projection's weight saves (kernels/l2_prefetch.py), one GPU.

For each weight (Nemotron-3-Nano-30B-A3B's Mamba out_proj and attention o_proj, [2688, 4096] bf16), the skinny
projection of one token is timed with CUDA events, median of many runs, L2 flushed (a 256 MB write) before each:
cold; after a window of idle GPU time (`torch.cuda._sleep`, standing for the conv / state update / norm kernels
between in_proj and out_proj) with and without a side-stream prefetch issued at the window's start; with the
weight already in L2 (the bound); and the prefetch kernel's own launch-to-exit time.

    python bench/l2_prefetch.py --out l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from hybridserve.kernels import ops
from hybridserve.kernels.l2_prefetch_triton import l2_prefetch_triton

SHAPES = {"30b out_proj / o_proj [2688, 4096]": (2688, 4096), "30b shared up [3712, 2688]": (3712, 2688)}


def timed(before: Callable[[], None], work: Callable[[], None], runs: int) -> float:
    """Median us of `work` (CUDA events around it) over `runs`, each after `before` (unfenced: same stream)."""
    times = []
    for _ in range(runs):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--window-us", type=float, nargs="+", default=[4.0, 7.0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    clock_hz = 1.98e9  # H100 / H200 boost clock: only sizes the idle windows
    flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device, priority=-1)
    results: dict[str, dict[str, float]] = {}

    def flush() -> None:
        flush_buf.fill_(1)

    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
        workspace = ops.split_k_workspace(weight)

        def linear(weight: torch.Tensor = weight, x: torch.Tensor = x, workspace: object = workspace) -> None:
            ops.linear(x, weight, None, workspace)

        for _ in range(3):  # compile + autotune outside the timings
            linear()
            l2_prefetch_triton(weight)
            l2_prefetch_triton(weight, bulk=False)
        torch.cuda.synchronize()
        row: dict[str, float] = {"weight MB": weight.numel() * 2 / 1e6}
        row["cold"] = timed(flush, linear, args.runs)
        row["warm (weight in L2)"] = timed(linear, linear, args.runs)
        row["prefetch kernel alone (bulk)"] = timed(flush, lambda w=weight: l2_prefetch_triton(w), args.runs)
        row["prefetch kernel alone (lines)"] = timed(flush, lambda w=weight: l2_prefetch_triton(w, bulk=False),
                                                     args.runs)
        for window in args.window_us:
            cycles = int(window * 1e-6 * clock_hz)
            row[f"idle {window} us, then linear (window included)"] = timed(
                flush, lambda c=cycles: (torch.cuda._sleep(c), linear()), args.runs)
            for bulk in (True, False):
                def overlapped(c: int = cycles, w: torch.Tensor = weight, b: bool = bulk) -> None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        l2_prefetch_triton(w, bulk=b)
                    torch.cuda._sleep(c)
                    linear()
                    torch.cuda.current_stream().wait_stream(side)

                row[f"idle {window} us with {'bulk' if bulk else 'line'} prefetch, then linear"] = timed(
                    flush, overlapped, args.runs)
        results[name] = row
        print(name, json.dumps({key: round(value, 2) for key, value in row.items()}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "runs": args.runs, "clock_hz": clock_hz,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
