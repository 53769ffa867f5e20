"""Decode projections at Nemotron-Nano-9B-v2 shapes: our skinny Triton linear against torch's (cuBLAS), both
replayed as CUDA graphs, beside the weight-read floor (the weight bytes over copy bandwidth).

    python bench/kernels/skinny_linear.py [--out bench/results/<device>/kernels/skinny_linear.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402

from hybridserve.kernels.skinny_linear_triton import skinny_linear_triton  # noqa: E402

SHAPES = {  # name: (out_features, in_features) of Nemotron-Nano-9B-v2
    "mamba in_proj": (22656, 4480),
    "mamba out_proj": (4480, 10240),
    "mlp up_proj": (15680, 4480),
    "mlp down_proj": (4480, 15680),
    "attn q_proj": (5120, 4480),
    "attn k_proj": (1024, 4480),
    "attn o_proj": (4480, 5120),
    "lm_head": (131072, 4480),
}
ROWS = (1, 4, 16)  # decode batch 1, a T=4 verify at batch 1, the kernel's largest tile


def _graph_us(fn: Callable[[], Any], quick: bool) -> float:
    """Median GPU time of fn as a CUDA-graph replay, in us (20 calls per graph: launch gaps amortised)."""
    graph = capture(lambda: [fn() for _ in range(20)])
    ms = do_bench(graph.replay, warmup=10 if quick else 25, rep=50 if quick else 200, return_mode="median")
    return float(ms) * 1e3 / 20


def bench_skinny_linear(ceil: dict, quick: bool) -> list[dict]:
    """Per shape and row count: ours, torch, the floor; GB/s of weight read."""
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (out_features, in_features) in SHAPES.items():
        weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        weight_bytes = weight.numel() * 2
        floor_us = weight_bytes / ceil["copy_GBps"] / 1e3
        for rows in ROWS:
            x = torch.randn(rows, in_features, device="cuda", generator=gen).to(torch.bfloat16)
            ref = torch.nn.functional.linear(x, weight)
            err = float((skinny_linear_triton(x, weight).float() - ref.float()).norm() / ref.float().norm())
            ours = _graph_us(lambda: skinny_linear_triton(x, weight), quick)
            torch_us = _graph_us(lambda: torch.nn.functional.linear(x, weight), quick)
            row = {"shape": name, "out_features": out_features, "in_features": in_features, "rows": rows,
                   "ours_us": ours, "torch_us": torch_us, "floor_us": floor_us, "speedup": torch_us / ours,
                   "ours_pct_copy": 100 * floor_us / ours, "torch_pct_copy": 100 * floor_us / torch_us,
                   "rel_err_vs_torch": err}
            print("linear " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in row.items()), flush=True)
            rows_out.append(row)
        del weight
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from kernel_table import ceilings  # the same copy / matmul ceilings as bench/kernels/kernel_table.py

    ceil = ceilings(args.quick)
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "linear": bench_skinny_linear(ceil, args.quick)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
