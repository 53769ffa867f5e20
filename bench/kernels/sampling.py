"""The step's sampling tail on the GPU: Gumbel-max (`engine.sampler.sample`, two launches) against the inverse-CDF
path it replaced (gather, tempered softmax, cumulative sum, search, scatter) and greedy argmax, same logits.

    python bench/kernels/sampling.py [--vocab 131072] [--rows 1 5 32 128] [--json OUT]

`tail_us`: GPU time of the sampling ops queued behind a device spin (the host is ahead, as when the forward still
runs: what a step's critical path pays after the forward); `wall_us`: one call from logits to host token ids with
the device idle (launch-bound). Medians of --repeats calls. Floor: the logits read once at copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.sampler import draw, params_probs, sample


def inverse_cdf(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """The sampler before Gumbel-max: every row through the tempered softmax and an inverse-CDF draw."""
    tokens = logits.argmax(dim=-1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    tokens[rows] = draw(params_probs(logits[rows], params), generators)
    return tokens.tolist()


def tail_us(fn: Callable[[], object], repeats: int) -> float:
    """Median GPU microseconds between events around fn, queued behind a spin so the host is never the limit."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms of device work ahead of the tail
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def wall_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 32, 128])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels/sampling.py times GPU kernels: it needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_s = tail_us(lambda: y.copy_(x), 20) / 1e6  # one 256 MiB copy: read + write
    copy_gbps = 2 * x.numel() / copy_s / 1e9
    results = []
    for num_rows in args.rows:
        logits = torch.randn(num_rows, args.vocab, device="cuda") * 3
        tempered = [SamplingParams(temperature=0.8)] * num_rows
        greedy = [SamplingParams(temperature=0.0)] * num_rows
        generators = [torch.Generator().manual_seed(i) for i in range(num_rows)]
        cases = {
            "gumbel": lambda: sample(logits, tempered, generators),
            "inverse_cdf": lambda: inverse_cdf(logits, tempered, generators),
            "greedy_argmax": lambda: sample(logits, greedy, generators),
        }
        for fn in cases.values():
            for _ in range(5):
                fn()  # compile, warm
        floor_us = logits.numel() * 4 / (copy_gbps * 1e9) * 1e6
        row = {"rows": num_rows, "vocab": args.vocab, "floor_us": round(floor_us, 2)}
        for name, fn in cases.items():
            row[f"{name}_tail_us"] = round(tail_us(fn, args.repeats), 1)
            row[f"{name}_wall_us"] = round(wall_us(fn, args.repeats), 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": props.name, "copy_gbps": round(copy_gbps, 1), "results": results}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
