"""What a mixed step (one prefill chunk beside running decodes) costs with the prefix cache on and off.

    python bench/mixed_step.py --decode-rows 1 4 8 --prompt-len 1024 --repeats 20 --out DIR

The same engine settings as the serving benchmark (Nemotron-Nano-9B-v2 shapes, dummy weights), built once with
the cache off and once with it on. For each number of decode rows it keeps that many requests decoding and
times, `--repeats` times, the step that prefills one fresh unique prompt beside them (wall time and the GPU
time between CUDA events), and the decode-only step, under torch.profiler; the kernels and CPU ops whose
totals over all measured steps differ most between cache on and off are written to DIR/mixed_step_diff.txt.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.sampling_params import SamplingParams


class StepTimer:
    """Wall and (on CUDA) GPU milliseconds of one engine step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, engine: LLMEngine) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if self.cuda:
            end.record()
            torch.cuda.synchronize()
            return wall * 1e3, start.elapsed_time(end)
        return wall * 1e3, wall * 1e3


def start_decoders(engine: LLMEngine, count: int, prompt_len: int, seed: int) -> list[str]:
    """`count` requests that keep decoding for the whole measurement."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len - 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(count, prompt_len, seed, vocab)]
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return ids


def measure(engine: LLMEngine, rows: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    timer = StepTimer(engine.config.torch_device.type == "cuda")
    decoders = start_decoders(engine, rows, args.prompt_len, seed)
    vocab = engine.model_config.vocab_size
    mixed: list[tuple[float, float]] = []
    decode: list[tuple[float, float]] = []
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities) if args.out else contextlib.nullcontext()
    with profiler as prof:  # over every measured step: one outlier step shows in the totals, not only in the median
        for i in range(args.repeats):
            prompt = random_prompts(1, args.prompt_len, seed * 1000 + i + 1, vocab)[0]
            rid = engine.add_request(prompt, params)
            mixed.append(timer(engine))  # the prompt's one prefill chunk beside `rows` decodes
            engine.abort(rid)
            decode.append(timer(engine))
    profile = None
    if args.out:
        profile = {e.key: (e.self_cpu_time_total, getattr(e, "self_device_time_total", 0.0), e.count)
                   for e in prof.key_averages()}
    for rid in decoders:
        engine.abort(rid)
    engine.step()
    return {
        "decode_rows": rows,
        "mixed_wall_ms_p50": statistics.median(m[0] for m in mixed),
        "mixed_gpu_ms_p50": statistics.median(m[1] for m in mixed),
        "decode_wall_ms_p50": statistics.median(d[0] for d in decode),
        "decode_gpu_ms_p50": statistics.median(d[1] for d in decode),
        "mixed_ms": [[round(w, 3), round(g, 3)] for w, g in mixed],
        "decode_ms": [[round(w, 3), round(g, 3)] for w, g in decode],
        "profile": profile,
    }


def diff_table(off: dict[str, tuple], on: dict[str, tuple], column: int, label: str) -> str:
    keys = set(off) | set(on)
    rows = sorted(keys, key=lambda k: -abs(on.get(k, (0, 0, 0))[column] - off.get(k, (0, 0, 0))[column]))[:25]
    lines = [f"{label} (us): off / on / on-off / calls off, on"]
    for k in rows:
        a, b = off.get(k, (0.0, 0.0, 0)), on.get(k, (0.0, 0.0, 0))
        lines.append(f"{a[column]:10.1f} {b[column]:10.1f} {b[column] - a[column]:+10.1f}  {a[2]:5d} {b[2]:5d}  {k[:90]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="directory for mixed_step.json and mixed_step_diff.txt")
    args = parser.parse_args()
    model_dir = dummy_model_dir(args.dummy_config) if args.model is None else Path(args.model)
    results: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for caching in (False, True, False, True):  # alternated, so drift hits both settings alike
        engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=caching))
        for seed, rows in enumerate(args.decode_rows):
            results["on" if caching else "off"].append(measure(engine, rows, args, seed + 1))
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summary = []
    for index, rows in enumerate(args.decode_rows):
        entry: dict[str, Any] = {"decode_rows": rows}
        for key in ("off", "on"):
            runs = [results[key][index], results[key][index + len(args.decode_rows)]]
            for field in ("mixed_wall_ms_p50", "mixed_gpu_ms_p50", "decode_wall_ms_p50", "decode_gpu_ms_p50"):
                entry[f"{key}_{field}"] = round(statistics.mean(r[field] for r in runs), 3)
        summary.append(entry)
        print(json.dumps(entry))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        runs = {key: [{k: v for k, v in r.items() if k != "profile"} for r in value] for key, value in results.items()}
        (out / "mixed_step.json").write_text(json.dumps({"device": device, "args": vars(args), "summary": summary,
                                                         "runs": runs}, indent=2) + "\n")
        parts = []
        for index, rows in enumerate(args.decode_rows):
            off = results["off"][index + len(args.decode_rows)]["profile"] or {}
            on = results["on"][index + len(args.decode_rows)]["profile"] or {}
            parts.append(f"## {rows} decode rows + {args.prompt_len}-token prefill\n"
                         + diff_table(off, on, 1, "self device time") + "\n\n" + diff_table(off, on, 0, "self CPU time"))
        (out / "mixed_step_diff.txt").write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
