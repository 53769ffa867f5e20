"""What the host pays to queue one op of a prefill step (a 9B prefill step is bound by its launches).

    python bench/system/host_ops.py [--json OUT]

The GPU is first given a long spin, so each op's time is the host's own cost of queueing it (never a wait for
the device): the prefill GEMMs of Nemotron-Nano-9B-v2's shapes through torch's linear, mm, and cuBLASLt, next to
torch.empty, an elementwise op and one of our Triton kernels, median over many calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve.kernels import ops

SHAPES = {  # name: (out features, in features) of the 9B's prefill GEMMs
    "mamba in_proj": (17504, 4480),
    "mamba out_proj": (4480, 8960),
    "mlp up": (15680, 4480),
    "mlp down": (4480, 15680),
}


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host microseconds per call, in batches of 10 behind a device spin."""
    per_call = []
    for _ in range(calls // 10):
        torch.cuda._sleep(40_000_000)  # ~20 ms: nothing below waits for the device
        start = time.perf_counter()
        for _ in range(10):
            fn()
        per_call.append((time.perf_counter() - start) / 10 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows: dict[str, float] = {}
    for tokens in args.tokens:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(tokens, n, device=dev, dtype=torch.bfloat16)
            wt = w.t()
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                torch.nn.functional.linear(x, w)
                rows[f"{tokens} {name} F.linear [{library}]"] = host_us(lambda: torch.nn.functional.linear(x, w), args.calls)
                rows[f"{tokens} {name} mm out= [{library}]"] = host_us(lambda: torch.mm(x, wt, out=out), args.calls)
            torch.backends.cuda.preferred_blas_library("cublas")
    x = torch.randn(1024, 4480, device=dev, dtype=torch.bfloat16)
    rows["torch.empty 1024x4480"] = host_us(lambda: torch.empty(1024, 4480, device=dev, dtype=torch.bfloat16), args.calls)
    rows["torch.where small"] = host_us(lambda: torch.where(x[:4, 0] > 0, x[:4, 1], -1.0), args.calls)
    weight = torch.ones(4480, device=dev, dtype=torch.bfloat16)
    residual = torch.zeros(1024, 4480, device=dev, dtype=torch.float32)
    ops.add_rmsnorm(x, residual, weight, 1e-5)
    rows["triton add_rmsnorm 1024 rows"] = host_us(lambda: ops.add_rmsnorm(x, residual, weight, 1e-5), args.calls)
    result = {"device": torch.cuda.get_device_name(), "host_us_per_call": rows}
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
