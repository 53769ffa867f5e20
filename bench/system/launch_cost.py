"""What the host pays per Triton launch of a prefill step, and what each part of Triton's launch path costs.

    python bench/system/launch_cost.py [--prompt-len 1024] [--decode-rows 4] [--json OUT]

Records every Triton launch of one engine step that prefills a fresh prompt beside running decodes
(Nemotron-Nano-9B-v2 shapes, dummy weights, as `mixed_step.py`), then replays each recorded launch behind a device
spin (so the figures are the host's own queueing cost) through: Triton's `kernel[grid]` (for autotuned kernels
the autotuner first), `JITFunction.run` alone, its argument binder alone (specialization), binder + cache-key
lookup, the compiled kernel's launcher alone, and the lean path of `hybridserve.kernels.launch` (binder, our
key, the C launcher). Per kernel and summed over the step, so the lean path's saving is known before serving.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mixed_step import inject, retire, start_decoders
from one_batch import add_engine_flags, dummy_model_dir, engine_config, sync
from triton import knobs
from triton.runtime import driver
from triton.runtime import jit as triton_jit

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.kernels import launch


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host microseconds per call, in batches of 10 behind a device spin."""
    per_call = []
    for _ in range(max(1, calls // 10)):
        torch.cuda._sleep(20_000_000)
        start = time.perf_counter()
        for _ in range(10):
            fn()
        per_call.append((time.perf_counter() - start) / 10 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def record_step(engine: LLMEngine, length: int) -> list[tuple[launch.LeanKernel, Any, tuple, dict]]:
    """(kernel, grid, args, kwargs) of every Triton launch in the step that prefills `length` tokens."""
    calls: list[tuple[launch.LeanKernel, Any, tuple, dict]] = []
    original = launch.LeanKernel.launch

    def recording(self: launch.LeanKernel, grid: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        calls.append((self, grid, args, dict(kwargs)))
        original(self, grid, args, kwargs)

    rid = inject(engine, length, 4242)
    sync(engine)
    launch.LeanKernel.launch = recording  # type: ignore[method-assign]
    try:
        engine.step()
    finally:
        launch.LeanKernel.launch = original  # type: ignore[method-assign]
    sync(engine)
    retire(engine, rid)
    return calls


def variants(lean: launch.LeanKernel, grid: Any, args: tuple, kwargs: dict) -> dict[str, Callable[[], object]]:
    """The launch paths to time for one recorded launch (each launches the kernel, except binder / key)."""
    jit = lean._jit
    if lean._tuner is not None:
        config = lean._tuned_config(args, kwargs)
        assert config is not None, "a recorded launch of a tuned kernel has its config"
        kwargs_jit = {**kwargs, **config.all_kwargs()}
    else:
        kwargs_jit = kwargs
    device = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = jit.device_caches[device]
    # what JITFunction.run adds to the options before binding (its cache key includes them)
    full = dict(kwargs_jit, debug=kwargs_jit.get("debug", jit.debug) or knobs.runtime.debug,
                instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, spec, options = binder(*args, **full)
    kernel = kernel_cache[triton_jit.compute_cache_key(key_cache, spec, options)]
    g = grid(bound) if callable(grid) else grid
    g = tuple(g) + (1,) * (3 - len(g))
    values = tuple(bound.values())
    stream = driver.active.get_current_stream(device)

    def key() -> object:
        b, s, o = binder(*args, **full)
        return kernel_cache.get(triton_jit.compute_cache_key(key_cache, s, o))

    return {
        "triton": lambda: lean.kernel[grid](*args, **kwargs),  # kernel[grid]: the autotuner's path, JITFunction.run
        "jit_run": lambda: jit.run(*args, grid=grid, warmup=False, **kwargs_jit),
        "binder": lambda: binder(*args, **full),
        "binder+key": key,
        "launcher": lambda: kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                                       None, None, *values),
        "lean": lambda: lean[grid](*args, **kwargs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decode-rows", type=int, default=4)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = dummy_model_dir(args.dummy_config) if args.model is None else Path(args.model)
    engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=True))
    decoders = start_decoders(engine, args.decode_rows, 256, 1)
    calls = record_step(engine, args.prompt_len)
    per_kernel: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    seen: dict[str, int] = collections.Counter()
    for lean, grid, a, kw in calls:
        name = lean._jit.__name__
        seen[name] += 1
        if seen[name] > 3:  # a few instances per kernel: the same shapes repeat in every layer
            continue
        for variant, call in variants(lean, grid, a, kw).items():
            per_kernel[name][variant].append(host_us(call, args.calls))
    sync(engine)
    rows = {}
    totals: dict[str, float] = collections.Counter()
    for name, found in per_kernel.items():
        row = {v: round(statistics.median(us), 2) for v, us in found.items()}
        row["launches_per_step"] = seen[name]
        rows[name] = row
        for v, us in row.items():
            if v != "launches_per_step":
                totals[v] += us * seen[name]
    result = {
        "device": torch.cuda.get_device_name(),
        "prompt_len": args.prompt_len,
        "decode_rows": args.decode_rows,
        "launches_per_step": len(calls),
        "host_us_per_launch": rows,
        "host_ms_per_step": {v: round(t / 1e3, 2) for v, t in totals.items()},
    }
    for rid in decoders:
        engine.abort(rid)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
