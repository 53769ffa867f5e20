"""What a mixed step (one prefill chunk beside running decodes) costs with the prefix cache on and off.

    python bench/system/mixed_step.py --decode-rows 1 4 8 --prompt-len 1024 --repeats 20 --out DIR

The same engine settings as the serving benchmark (Nemotron-Nano-9B-v2 shapes, dummy weights), built once with the
cache off and once with it on, stepping synchronously (the step whose phases it times). For each number of decode
rows it keeps that many requests decoding and times, `--repeats` times, the step that prefills one fresh unique
prompt beside them (wall time and the GPU time between CUDA events), and the decode-only step, under
torch.profiler; the kernels and CPU ops whose totals over all measured steps differ most between cache on and off
are written to DIR/mixed_step_diff.txt.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, sync

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.worker_runtime.gc_pauses import GcPauses


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


ONE_TOKEN = SamplingParams(max_tokens=2, ignore_eos=True)


def inject(engine: LLMEngine, length: int, seed: int) -> str | None:
    """A fresh unique prompt of `length` tokens for the next step to prefill (None for length 0: no prompt)."""
    if not length:
        return None
    return engine.add_request(random_prompts(1, length, seed, engine.model_config.vocab_size)[0], ONE_TOKEN)


def retire(engine: LLMEngine, request_id: str | None) -> None:
    """Abort an injected prompt after its prefill step and step once, so the decode rows are alone again."""
    if request_id is not None:
        engine.abort(request_id)
        engine.step()


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


def sync_sites(engine: LLMEngine, rows: int, args: argparse.Namespace) -> str:
    """Where the host waits for the device in a mixed and a decode step: every synchronising CUDA call (torch's
    sync debug mode) counted by the project frames that made it. Each sync inside the forward idles the GPU
    while the host queues the rest of the step."""
    decoders = start_decoders(engine, rows, args.prompt_len, 777)
    sites: dict[str, collections.Counter[str]] = {"mixed": collections.Counter(), "decode": collections.Counter()}
    kind = "mixed"

    def record(message: Warning | str, *_: object, **__: object) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "hybridserve" in f.filename or "/engine/" in f.filename
                  or "/models/" in f.filename or "/kernels/" in f.filename or "/statepool/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1])
        sites[kind][where or str(message)[:120]] += 1

    steps = 3
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record  # type: ignore[assignment]
            for i in range(steps):
                kind = "mixed"
                rid = inject(engine, args.prompt_len, 5000 + i)
                engine.step()
                kind = "decode"
                retire(engine, rid)  # its step is a decode step of the decode rows alone
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for rid in decoders:
        engine.abort(rid)
    engine.step()
    lines = []
    for name, counter in sites.items():
        lines.append(f"## {name} step ({rows} decode rows, {args.prompt_len}-token prefill in mixed): "
                     f"{sum(counter.values()) / steps:.1f} syncs per step")
        lines.extend(f"{n / steps:6.1f}  {where}" for where, n in counter.most_common())
    return "\n".join(lines) + "\n"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def timeline(engine: LLMEngine, rows: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Per mixed step, from a profiler trace: wall time, GPU kernel busy time (union of kernel intervals), when the
    host had queued the step's last kernel, and the GPU's idle gaps over 100 us (what the host was doing): a step
    whose busy time is far below its wall time is host-bound."""
    decoders = start_decoders(engine, rows, args.prompt_len, 888)
    lengths = [int(n) for n in args.timeline_lens.split(",")]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i, length in enumerate(lengths * 3):
            sync(engine)
            rid = inject(engine, length, 9000 + i)
            with torch.profiler.record_function(f"step_{length}"):
                engine.step()
            sync(engine)
            retire(engine, rid)
    trace = out / "mixed_step_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "aunch" in e.get("name", "")]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("dur", 0) > 0]
    steps = [e for e in events if e.get("name", "").startswith("step_") and e.get("cat") == "user_annotation"]
    result = []
    for step in sorted(steps, key=lambda e: e["ts"]):
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        inside = [(a, min(b, t1)) for a, b in kernels if t0 <= a <= t1]  # the step ends with the sampler's sync
        last_launch = max((e["ts"] for e in launches if t0 <= e["ts"] <= t1), default=t0)
        gaps = []
        ordered = sorted(inside)
        end = t0
        for a, b in ordered:
            if a - end > 100:
                busy_ops = [o for o in ops if o["ts"] <= a <= o["ts"] + o["dur"] and o["ts"] >= end - 5e4]
                gaps.append({"at_ms": round((end - t0) / 1e3, 2), "gap_ms": round((a - end) / 1e3, 2),
                             "host_in": [o["name"] for o in sorted(busy_ops, key=lambda o: -o["dur"])[:3]]})
            end = max(end, b)
        result.append({"step": step["name"], "wall_ms": round((t1 - t0) / 1e3, 2),
                       "kernel_busy_ms": round(busy_union(inside) / 1e3, 2),
                       "last_launch_ms": round((last_launch - t0) / 1e3, 2),
                       "kernels": len(inside), "gaps_over_100us": len(gaps),
                       "gap_total_ms": round(sum(g["gap_ms"] for g in gaps), 2), "largest_gaps":
                       sorted(gaps, key=lambda g: -g["gap_ms"])[:8]})
    trace.unlink()
    for rid in decoders:
        engine.abort(rid)
    engine.step()
    return {"decode_rows": rows, "steps": result}


def host_time(engine: LLMEngine, rows: int, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The host's own cost of queueing a step: the GPU is first given a ~0.5 s spin, so the time from the step's
    start to the sampler (where the step first waits for the device) is pure host work, never the host waiting.
    A step whose host time exceeds its GPU time is host-bound. One 1024-token step is also run under cProfile
    (the functions with the most own time, into DIR/host_profile.txt)."""
    import cProfile
    import io
    import pstats

    from hybridserve.engine import model_runner

    decoders = start_decoders(engine, rows, args.prompt_len, 999)
    reached: list[float] = []
    reached_cpu: list[float] = []  # the thread's CPU clock there (after it, the step's sync spins the CPU)
    original = model_runner.sample

    def timed_sample(*a: Any, **k: Any) -> Any:
        reached.append(time.perf_counter())
        reached_cpu.append(time.thread_time())
        return original(*a, **k)

    model_runner.sample = timed_sample  # type: ignore[assignment]
    gc_pauses = GcPauses()
    results = []
    runner = engine.runner
    # split: decode rows replay their graph beside an eager prefill; whole: one eager forward with recurrent
    # decode rows
    modes = ("split", "whole") if runner.decode_graphs is not None else ("whole",)
    try:
        for length in [int(n) for n in args.timeline_lens.split(",")]:
            hosts: dict[str, list[float]] = {m: [] for m in modes}
            cpus: dict[str, list[float]] = {m: [] for m in modes}  # the thread's CPU time in the host phase
            gcs: dict[str, list[float]] = {m: [] for m in modes}  # garbage-collector pauses in the host phase
            walls: dict[str, list[float]] = {m: [] for m in modes}
            for i in range(args.repeats):
                for split in modes:  # alternated step for step, so drift hits all alike
                    runner.split_mixed = split == "split"
                    sync(engine)
                    rid = inject(engine, length, 7000 + i)
                    if torch.cuda.is_available():
                        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device spin ahead of the step
                    reached.clear()
                    reached_cpu.clear()
                    gc_pauses.total = 0.0
                    cpu_start = time.thread_time()
                    start = time.perf_counter()
                    if length == 1024 and i == args.repeats - 1 and split == modes[0]:
                        prof = cProfile.Profile()
                        prof.enable()
                        engine.step()
                        prof.disable()
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
                        pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats(45)
                        (out / "host_profile.txt").write_text(text.getvalue())
                    else:
                        engine.step()
                        hosts[split].append(1e3 * (reached[0] - start))
                        cpus[split].append(1e3 * (reached_cpu[0] - cpu_start))  # the host phase only
                        gcs[split].append(1e3 * gc_pauses.total)
                    sync(engine)
                    retire(engine, rid)
                    # the same step without the spin: its wall time (host and device overlapping as served)
                    rid = inject(engine, length, 8000 + i)
                    sync(engine)
                    start = time.perf_counter()
                    engine.step()
                    sync(engine)
                    walls[split].append(1e3 * (time.perf_counter() - start))
                    retire(engine, rid)
            for split in modes:
                results.append({"decode_rows": rows, "prefill_tokens": length, "mode": split,
                                "host_ms_p50": statistics.median(hosts[split]), "host_ms_min": min(hosts[split]),
                                "host_ms": [round(h, 2) for h in hosts[split]],
                                "thread_cpu_ms": [round(c, 2) for c in cpus[split]],
                                "gc_pause_ms": [round(g, 3) for g in gcs[split]],
                                "wall_ms_p50": statistics.median(walls[split]), "wall_ms_min": min(walls[split]),
                                "wall_ms": [round(w, 2) for w in walls[split]]})
                print({k: v for k, v in results[-1].items() if not isinstance(v, list)})
    finally:
        runner.split_mixed = engine.config.split_mixed_steps and engine.tp is None
        model_runner.sample = original  # type: ignore[assignment]
        gc_pauses.close()
    for rid in decoders:
        engine.abort(rid)
    engine.step()
    return results


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
    parser.add_argument("--sync-sites", action="store_true",
                        help="only list where a mixed and a decode step synchronise with the GPU (cache on, as "
                             "served), into DIR/sync_sites.txt")
    parser.add_argument("--timeline", action="store_true",
                        help="only trace steps with --timeline-lens prefill tokens beside the first --decode-rows "
                             "(cache on): wall vs GPU busy time and idle gaps, into DIR/mixed_step_timeline.json")
    parser.add_argument("--timeline-lens", default="0,512,1024,2048")
    parser.add_argument("--host-time", action="store_true",
                        help="only measure the host's cost of queueing steps with --timeline-lens prefill tokens "
                             "(cache on), into DIR/mixed_step_host.json and DIR/host_profile.txt")
    args = parser.parse_args()
    model_dir = dummy_model_dir(args.dummy_config) if args.model is None else Path(args.model)
    if args.host_time or args.timeline:  # one engine with the cache on, as served
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=True, async_scheduling=False))
    if args.host_time:
        found_host = host_time(engine, args.decode_rows[0], args, out)
        (out / "mixed_step_host.json").write_text(json.dumps(found_host, indent=1) + "\n")
        return
    if args.timeline:
        found = timeline(engine, args.decode_rows[0], args, out)
        (out / "mixed_step_timeline.json").write_text(json.dumps(found, indent=1) + "\n")
        for row in found["steps"]:
            print({k: v for k, v in row.items() if k != "largest_gaps"})
        return
    if args.sync_sites:
        engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=True, async_scheduling=False))
        text = sync_sites(engine, args.decode_rows[0], args)
        print(text)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "sync_sites.txt").write_text(text)
        return
    results: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for caching in (False, True, False, True):  # alternated, so drift hits both settings alike
        engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=caching, async_scheduling=False))
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
