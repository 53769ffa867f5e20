"""Where a served step's time goes: the offline engine replaying a serving workload, step by step.

    python bench/system/engine_trace.py --rate 8 --num-prompts 64 --input-len 1024 --output-len 64 --out DIR

Requests arrive on a Poisson clock and are added to the engine between steps, as the worker's engine loop
does, with no server around it. Every step records its shape (decode rows, prefill tokens), its time split
into schedule / forward+sample / commit / outputs, and how many Triton kernels compiled during it. Each pass
runs twice on the same engine (cold, then warm with fresh prompts), with prefix caching off and on, so the
result separates compile stalls, cache cost and the engine's own step time from what the server adds.
A torch.profiler window over warm mixed steps writes the top kernels and CPU ops to DIR/profile_*.txt.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from one_batch import CompileCounter, add_engine_flags, dummy_model_dir, engine_config, random_prompts

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.deploy.process_heap import freeze_startup_heap
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.worker_runtime.gc_pauses import GcPauses


class Timers:
    """Wall time spent in selected methods, per step (wrapped in place)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = {k: round(v * 1e3, 3) for k, v in self.spent.items()}
        self.spent.clear()
        return out


def poisson(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


def replay(engine: LLMEngine, prompts: list[list[int]], output_len: int, rate: float, timers: Timers,
           compiles: CompileCounter, profile_steps: range | None = None, profile_out: Path | None = None
           ) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    arrivals = poisson(rate, len(prompts), 0)
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    steps: list[dict[str, Any]] = []
    profiler: contextlib.AbstractContextManager[Any] | None = None
    gc_pauses = GcPauses()
    start = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rid = engine.add_request(prompts[nxt], params)
            arrived[rid] = start + arrivals[nxt]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        if profile_steps is not None and len(steps) == profile_steps.start:
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                if torch.cuda.is_available() else [torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        work_before = compiles.count
        num_decode = sum(1 for r in engine.scheduler.running if r.is_decoding)
        gc_pauses.total = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if profiler is not None and profile_steps is not None and len(steps) + 1 == profile_steps.stop:
            profiler.__exit__(None, None, None)
            write_profile(profiler, profile_out)
            profiler = None
        for out in outs:
            if out.num_tokens and out.request_id not in first:
                first[out.request_id] = t1
            if out.finished:
                done[out.request_id] = (t1, out.num_tokens)
        steps.append({"ms": round((t1 - t0) * 1e3, 3), "decode_rows": num_decode,
                      "prefill_tokens": getattr(engine, "_last_prefill_tokens", None),
                      "compiles": compiles.count - work_before, "gc": round(1e3 * gc_pauses.total, 3),
                      **timers.take()})
    end = time.perf_counter()
    gc_pauses.close()
    ttft = [1e3 * (first[r] - arrived[r]) for r in arrived]
    tpot = [1e3 * (done[r][0] - first[r]) / (done[r][1] - 1) for r in arrived if done[r][1] > 1]
    decode_steps = [s for s in steps if s["prefill_tokens"] == 0]
    decode_only = [s["ms"] for s in decode_steps]
    mixed = [s["ms"] for s in steps if s["prefill_tokens"]]
    return {
        "requests_per_s": len(prompts) / (end - start),
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": sorted(ttft)[int(0.99 * (len(ttft) - 1))],
        "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p99": sorted(tpot)[int(0.99 * (len(tpot) - 1))],
        "steps": len(steps), "compiles": sum(s["compiles"] for s in steps),
        "decode_only_step_ms_p50": statistics.median(decode_only) if decode_only else None,
        "mixed_step_ms_p50": statistics.median(mixed) if mixed else None,
        "mean_decode_rows": statistics.mean(s["decode_rows"] for s in steps),
        "split_ms_mean": {k: round(statistics.mean(s.get(k, 0.0) for s in steps), 3)
                          for k in ("schedule", "plan", "execute", "update", "commit", "gc")},
        # decode-only steps: where a cache-on decode step's extra time goes (host phases vs execute)
        "decode_split_ms_p50": {k: round(statistics.median(s.get(k, 0.0) for s in decode_steps), 3)
                                for k in ("ms", "schedule", "execute", "update", "commit", "gc")} if decode_steps else None,
        "gc_ms_total": round(sum(s["gc"] for s in steps), 1),
        "step_log": steps,
    }


def write_profile(profiler: Any, out: Path | None) -> None:
    if out is None:
        return
    averages = profiler.key_averages()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    text = averages.table(sort_by=sort, row_limit=40) + "\n\n" + averages.table(sort_by="cpu_time_total", row_limit=40)
    out.write_text(text)


def instrument(engine: LLMEngine, timers: Timers) -> None:
    """Time the parts of `step()`; remember each step's prefill token count."""
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.pool, "plan_checkpoints", "plan")
    timers.wrap(engine.runner, "execute", "execute")
    timers.wrap(engine.pool, "commit", "commit")
    timers.wrap(engine.scheduler, "update_from_output", "update")
    inner = engine.scheduler.schedule

    def schedule() -> Any:
        work = inner()
        engine._last_prefill_tokens = sum(c.num_tokens for c in work.prefills)  # type: ignore[attr-defined]
        return work

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]


@contextlib.contextmanager
def engine_for(args: argparse.Namespace, model_dir: Path, **overrides: Any) -> Iterator[LLMEngine]:
    engine = LLMEngine(model_dir, engine_config(args, **overrides))
    try:
        yield engine
    finally:
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--caching", default="off,on", help="prefix caching settings to run, in order")
    parser.add_argument("--out", default="engine_trace", help="output directory")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="freeze the heap after each engine's start-up, as a serving worker does")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    compiles = CompileCounter()
    result: dict[str, Any] = {"args": vars(args)}
    for caching in args.caching.split(","):
        before = compiles.count
        t0 = time.perf_counter()
        with engine_for(args, model_dir, enable_prefix_caching=caching == "on") as engine:
            report = engine.warmup_report
            result[f"cache_{caching}_startup"] = {
                "engine_init_s": round(time.perf_counter() - t0, 2), "compiles": compiles.count - before,
                "warmup_s": round(report.seconds, 2) if report is not None else None,
                "warmup_steps": report.num_steps if report is not None else None,
            }
            if args.gc_freeze:
                freeze_startup_heap(f"engine_trace cache {caching}")
            timers = Timers()
            instrument(engine, timers)
            vocab = engine.model_config.vocab_size
            # cold: the first traffic after ready; warm: the same workload again; profile: a short third pass
            # under torch.profiler (kept apart: the profiler slows the steps it records)
            for phase, seed in (("cold", 100), ("warm", 200), ("profile", 300)):
                prompts = random_prompts(args.num_prompts if phase != "profile" else 24, args.input_len, seed, vocab)
                profile = range(5, 25) if phase == "profile" else None
                run = replay(engine, prompts, args.output_len, args.rate, timers, compiles, profile,
                             out / f"profile_cache_{caching}.txt")
                if phase == "profile":
                    continue
                result[f"cache_{caching}_{phase}"] = run
                summary = {k: v for k, v in run.items() if k != "step_log"}
                print(f"cache {caching} {phase}: {json.dumps(summary)}", flush=True)
    result["compiled_kernels"] = dict(compiles.names)
    (out / "engine_trace.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
