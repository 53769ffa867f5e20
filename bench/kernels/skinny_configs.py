"""Every tile / split-K config of the skinny decode projection (kernels/skinny_linear_triton.py) at the pipeline
depths given by --stages, on Nemotron-3-Nano-30B-A3B's shapes, one token, one GPU: weight cold in L2 (a 128 MB
write before each call) and warm (the same call repeated), timed as CUDA-graph replays of 20 calls (minus a graph of
the flushes alone), beside the autotuner's pick and the copy-bandwidth floor.

    python bench/kernels/skinny_configs.py --stages 3 4 5 6 --out skinny_configs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402

from hybridserve.kernels import ops  # noqa: E402
from hybridserve.kernels.skinny_linear_triton import _configs, _prune, _skinny_linear_kernel, _skinny_split  # noqa: E402
from hybridserve.kernels.triton_utils import cdiv  # noqa: E402

SHAPES = {"out_proj / o_proj": (2688, 4096), "in_proj": (10304, 2688), "qkv": (4608, 2688)}
REPS = 20


def graph_us(body: Callable[[], None], repeats: int = 15) -> float:
    """Median us of one replay of a graph of `body` (bench/kernels/cuda_graph.py's capture: after a warm-up call)."""
    graph = capture(body)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-gbps", type=float, default=4244.0, help="copy bandwidth for the floor")
    parser.add_argument("--stages", type=int, nargs="+", default=[3], help="software-pipeline depths to sweep")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush_buf = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    flush_us = graph_us(lambda: [flush_buf.fill_(1) for _ in range(REPS)])
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "flush_us_x20": flush_us, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
        y = torch.empty(1, n, dtype=torch.bfloat16, device=device)
        ws = ops.split_k_workspace(weight)  # split-K scratch where the projection has few output columns
        ops.linear(x, weight, None, ws)  # the autotuner's pick for this shape
        torch.cuda.synchronize()
        picked = getattr(_skinny_split if ws is not None else None, "best_config", None)
        floor = n * k * 2 / (args.copy_gbps * 1e3)
        configs = [triton.Config(c.kwargs, num_warps=4, num_stages=s) for s in args.stages
                   for c in _configs(split=ws is not None) if c.num_warps == 4 and c.num_stages == 3]
        configs = _prune(configs, {"N": n, "K": k, "w_ptr": weight}) if ws is not None else configs
        rows = []
        for c in configs:
            kw = dict(c.kwargs)
            scratch = (ws.partials, ws.arrivals) if ws is not None else (y, y)

            def call(kw: dict = kw, c: object = c, scratch: tuple = scratch) -> None:
                grid = (cdiv(n, kw["BLOCK_N"]), kw["SPLIT_K"])
                _skinny_linear_kernel[grid](x, weight, weight, y, *scratch, 1, n, k, x.stride(0), weight.stride(0),
                                            y.stride(0), HAS_BIAS=False, DOT_PRECISION="tf32", USE_PDL=False,
                                            num_warps=c.num_warps, num_stages=c.num_stages, **kw)

            cold = (graph_us(lambda call=call: [(flush_buf.fill_(1), call()) for _ in range(REPS)]) - flush_us) / REPS
            warm = graph_us(lambda call=call: [call() for _ in range(REPS)]) / REPS
            rows.append({"config": {**kw, "warps": c.num_warps, "stages": c.num_stages}, "cold_us": round(cold, 2),
                         "warm_us": round(warm, 2)})
        rows.sort(key=lambda r: r["cold_us"])
        report["shapes"][name] = {"shape": [n, k], "floor_us": round(floor, 2), "autotuned": str(picked),
                                  "best5": rows[:5], "all": rows}
        print(name, "floor", round(floor, 2), "autotuned", picked, flush=True)
        for r in rows[:8]:
            print("   ", r, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
