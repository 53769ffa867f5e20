"""Do green-context SM partitions hold on this GPU? What the engine's prefill/decode multiplexing relies on.

    python bench/kernels/sm_partition_scaling.py [--out bench/results/h200/multiplex/sm_partition_scaling.json]

Measures, with the lanes of `engine/sm_partition.py`:
- placement: which SMs a lane's programs run on (%smid read by a Triton kernel): each lane uses as many SMs as it
  was given, and the two lanes of a split never share one;
- scaling: a cuBLAS bf16 8192^3 GEMM, a decode-shaped skinny GEMM and two of our Triton kernels (the SSD scan of a
  prefill, the state update of a decode step) with k SMs against the whole GPU;
- isolation: a decode-like loop's per-iteration time alone in its lane and while the other lane runs prefill-like
  work, beside the same two loads on two plain streams (no partition);
- CUDA graphs: whether a graph captured on one stream runs inside the partition of the stream it is replayed on
  (then decode graphs need no capture per partition), and capture on a lane's stream;
- the caching allocator and events across lanes; whether torch's GreenContext.create(num_sms=...) overlaps.
Each section records its error instead of stopping the run; a table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from hybridserve.engine.sm_partition import Lane, SmPartitioner, SmSplit, open_partitioner
from hybridserve.kernels import ops
from hybridserve.kernels.ssd_scan_meta import chunk_metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sm_probe import SmProbe  # noqa: E402

# prefill SMs wanted (on an H200, 132 SMs in groups of 8, decode lanes get 124, 116, 100, 68, 36, 12); counts the
# device's granularity cannot give beside a decode lane are dropped. Lanes of one group are measured here, below
# the two groups a serving lane keeps (engine/sm_partition.py MIN_LANE_GROUPS)
MENU = (8, 16, 32, 64, 96, 120)
NANO = {"hidden": 4480, "ffn": 15680, "heads": 128, "head_dim": 80, "groups": 8, "state": 128, "chunk": 128}


def timed_ms(fn: Callable[[], Any], reps: int, lane: Lane | None = None, warmup: int = 2) -> tuple[list[float], str]:
    """Per-call times of fn launched into `lane` (None: the default stream): CUDA events recorded on the lane's
    stream, or the host clock if events fail there."""
    with contextlib.nullcontext() if lane is None else lane:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        try:
            return per_iteration_ms(contextlib.nullcontext, fn, reps), "events"  # already inside the lane
        except RuntimeError:
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            return times, "host"


def median_ms(fn: Callable[[], Any], lane: Lane | None, reps: int = 20) -> float:
    return round(statistics.median(timed_ms(fn, reps, lane)[0]), 4)


def make_work() -> dict[str, Callable[[], Any]]:
    """The kernels timed per SM count (Nano-9B-v2 shapes), inputs made once."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(bf)

    a, b, c = r(8192, 8192), r(8192, 8192), torch.empty(8192, 8192, device="cuda", dtype=bf)
    x_dec, w_up = r(64, NANO["hidden"]), r(NANO["ffn"], NANO["hidden"], scale=0.02)
    h, p, g, n, chunk = NANO["heads"], NANO["head_dim"], NANO["groups"], NANO["state"], NANO["chunk"]
    tokens = 4 * 2048
    x, dt, B, C = r(tokens, h, p), r(tokens, h, scale=0.5), r(tokens, g, n), r(tokens, g, n)
    A = -torch.rand(h, device="cuda", generator=gen) * 4 - 0.5
    D, bias = torch.randn(h, device="cuda", generator=gen), torch.randn(h, device="cuda", generator=gen) * 0.5
    cu = torch.arange(0, tokens + 1, 2048, device="cuda")
    meta = chunk_metadata(cu, None, chunk, 1024, x.device)
    rows = 64
    pool = torch.randn(rows, h, p, n, device="cuda", generator=gen)
    slots = torch.randperm(rows, device="cuda", generator=gen)
    xs, dts, zs = r(rows, h, p), r(rows, h, scale=0.5), r(rows, h, p)
    Bs, Cs = r(rows, g, n), r(rows, g, n)

    def gemm_8192() -> Any:
        return torch.mm(a, b, out=c)

    def gemm_skinny() -> Any:
        return torch.nn.functional.linear(x_dec, w_up)

    def ssd_scan() -> Any:
        return ops.ssd_scan_varlen(x, dt, A, B, C, cu, chunk, D=D, dt_bias=bias, state_block=1024, meta=meta)

    def state_update() -> Any:
        return ops.selective_state_update(pool, slots, xs, dts, A, Bs, Cs, D=D, dt_bias=bias, z=zs)

    return {"gemm_bf16_8192^3": gemm_8192, "gemm_skinny_64x4480x15680": gemm_skinny,
            "ssd_scan_4x2048": ssd_scan, "state_update_64rows": state_update}


def decode_step(work: dict[str, Callable[[], Any]]) -> Callable[[], Any]:
    """A decode-like step: four skinny GEMMs (weights streamed from HBM) and a state update."""
    def step() -> None:
        for _ in range(4):
            work["gemm_skinny_64x4480x15680"]()
        work["state_update_64rows"]()
    return step


def lanes_by_sms(part: SmPartitioner) -> dict[int, Lane]:
    out: dict[int, Lane] = {}
    for split in part.splits:
        for lane in part.lanes(split):
            out.setdefault(lane.sm_count, lane)
    return dict(sorted(out.items()))


def placement(part: SmPartitioner, probe: SmProbe) -> dict[str, Any]:
    rows = []
    for split in part.splits:
        pre, dec = part.lanes(split)
        sp, sd = probe.on(pre), probe.on(dec)
        # both at once: queue both, then read both
        with pre:
            p2 = SmProbe(probe.programs, probe.spin * 4)
            p2.launch()
        with dec:
            d2 = SmProbe(probe.programs, probe.spin * 4)
            d2.launch()
        cp, cd = set(p2.used()), set(d2.used())
        rows.append({"split": str(split), "prefill_used": len(sp), "decode_used": len(sd),
                     "overlap": len(set(sp) & set(sd)), "concurrent_overlap": len(cp & cd),
                     "prefill_sms": sp, "decode_sms": sd})
    whole = probe.on(None)
    return {"whole_gpu_used": len(whole), "splits": rows}


def scaling(part: SmPartitioner, work: dict[str, Callable[[], Any]]) -> list[dict[str, Any]]:
    rows = []
    lanes: dict[int, Lane | None] = {**lanes_by_sms(part), part.total_sms: None}
    for name, fn in work.items():
        base = None
        for sms in sorted(lanes, reverse=True):
            reps = 5 if name.startswith("gemm_bf16") else 20
            times, clock = timed_ms(fn, reps, lanes[sms])
            ms = statistics.median(times)
            base = ms if base is None else base
            rows.append({"kernel": name, "sms": sms, "ms": round(ms, 4), "slowdown": round(ms / base, 3),
                         "ideal_slowdown": round(part.total_sms / sms, 3), "clock": clock})
    return rows


def per_iteration_ms(stream_ctx: Callable[[], Any], step: Callable[[], Any], iters: int) -> list[float]:
    """Per-iteration times of `step` queued back to back on the current stream of `stream_ctx`."""
    with stream_ctx():
        stream = torch.cuda.current_stream()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record(stream)
        for i in range(iters):
            step()
            events[i + 1].record(stream)
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(iters)]


def _summary(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"p50_ms": round(times[len(times) // 2], 4), "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 4),
            "mean_ms": round(statistics.fmean(times), 4)}


def isolation(part: SmPartitioner, work: dict[str, Callable[[], Any]], split: SmSplit) -> dict[str, Any]:
    """Decode loop alone vs beside a prefill load, in a split's lanes and on two plain streams."""
    pre, dec = part.lanes(split)
    step = decode_step(work)
    iters = 150
    loads = {"gemm": work["gemm_bf16_8192^3"], "ssd_scan": work["ssd_scan_4x2048"]}
    plain_a, plain_b = torch.cuda.Stream(), torch.cuda.Stream()
    out: dict[str, Any] = {"split": str(split)}
    for label, decode_ctx, prefill_ctx in (("partitioned", lambda: dec, lambda: pre),
                                           ("plain_streams", lambda: torch.cuda.stream(plain_a),
                                            lambda: torch.cuda.stream(plain_b))):
        per_iteration_ms(decode_ctx, step, 10)  # warm
        out[f"{label}_alone"] = _summary(per_iteration_ms(decode_ctx, step, iters))
        for load_name, load in loads.items():
            alone = per_iteration_ms(prefill_ctx, load, 3)
            with prefill_ctx():  # enough prefill work queued to outlast the decode loop
                needed = int(out[f"{label}_alone"]["mean_ms"] * iters * 2 / max(statistics.median(alone), 1e-3)) + 2
                for _ in range(min(needed, 400)):
                    load()
            times = per_iteration_ms(decode_ctx, step, iters)
            torch.cuda.synchronize()
            out[f"{label}_with_{load_name}"] = {**_summary(times), "prefill_calls": min(needed, 400),
                                                "prefill_ms_alone": round(statistics.median(alone), 4)}
    return out


def graphs(part: SmPartitioner, work: dict[str, Callable[[], Any]], probe: SmProbe) -> dict[str, Any]:
    """Where a captured graph runs: the SMs of the %smid kernel and a decode step's time, replayed on lanes."""
    small = min(lanes_by_sms(part).items())[1]
    big = max(lanes_by_sms(part).items())[1]
    step = decode_step(work)
    res: dict[str, Any] = {"small_lane_sms": small.sm_count, "big_lane_sms": big.sm_count}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        probe.launch()
        step()
    torch.cuda.synchronize()
    g_probe, g_step = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_probe):
        probe.launch()
    with torch.cuda.graph(g_step):
        step()
    probe.used()
    for where, lane in (("default", None), ("small_lane", small), ("big_lane", big)):
        res[f"plain_capture_replay_on_{where}_sms_used"] = len(_replay_sms(g_probe, probe, lane))
        res[f"plain_capture_replay_on_{where}_step_ms"] = median_ms(g_step.replay, lane)
        res[f"eager_on_{where}_step_ms"] = median_ms(step, lane)

    # capture on the small lane's own stream
    try:
        g_lane = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_lane, stream=small.stream):
            probe.launch()
        probe.used()
        for where, lane in (("default", None), ("small_lane", small), ("big_lane", big)):
            res[f"lane_capture_replay_on_{where}_sms_used"] = len(_replay_sms(g_lane, probe, lane))
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        res["lane_capture_error"] = repr(err)
    return res


def _replay_sms(graph: torch.cuda.CUDAGraph, probe: SmProbe, lane: Lane | None) -> list[int]:
    with contextlib.nullcontext() if lane is None else lane:
        graph.replay()
    return probe.used()


def allocator(part: SmPartitioner) -> dict[str, Any]:
    """Tensors made in one lane, used in the other after `wait_for`; freed and reused; memory stats."""
    pre, dec = part.lanes(part.splits[len(part.splits) // 2])
    before = torch.cuda.memory_allocated()
    with pre:
        a = torch.randn(4096, 4096, device="cuda")
        b = a * 2
    dec.wait_for(pre)
    with dec:
        c = b + 1
        b.record_stream(dec.stream)  # type: ignore[arg-type]
    pre.wait_for(dec)
    del b
    with pre:
        d = torch.empty(4096, 4096, device="cuda").fill_(3.0)  # may reuse b's block once dec is done
    torch.cuda.synchronize()
    ok = bool(torch.equal(c, a * 2 + 1)) and bool((d == 3).all())
    return {"cross_lane_result_ok": ok, "allocated_delta_mb": round((torch.cuda.memory_allocated() - before) / 2**20, 1)}


def torch_green_contexts(probe: SmProbe) -> dict[str, Any]:
    """Two contexts from torch's GreenContext.create(num_sms=32): do their SMs overlap?"""
    from torch.cuda.green_contexts import GreenContext

    ctxs = [GreenContext.create(num_sms=32, device_id=0) for _ in range(2)]
    used = []
    for ctx in ctxs:
        with torch.cuda.stream(ctx.Stream()):
            probe.launch()
        used.append(set(probe.used()))
    return {"sms_used": [len(u) for u in used], "overlap": len(used[0] & used[1])}


def section(result: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as err:  # noqa: BLE001 - one section's failure is a finding; the rest still runs
        result[name] = {"error": repr(err), "trace": traceback.format_exc()[-2000:]}
    print(f"[{name}] {time.perf_counter() - t0:.1f} s: {json.dumps(result[name])[:600]}", flush=True)


def print_table(result: dict[str, Any]) -> None:
    scal = result.get("scaling")
    if isinstance(scal, list):
        kernels = list(dict.fromkeys(r["kernel"] for r in scal))
        sms = sorted({r["sms"] for r in scal}, reverse=True)
        print("\nms per call with k SMs (slowdown vs whole GPU; ideal = 132/k)")
        print(f"{'k SMs':>6} {'ideal':>6} " + " ".join(f"{k[:26]:>28}" for k in kernels))
        for k in sms:
            cells = []
            for name in kernels:
                row = next(r for r in scal if r["kernel"] == name and r["sms"] == k)
                cells.append(f"{row['ms']:>16.3f} ({row['slowdown']:>6.2f}x)")
            print(f"{k:>6} {result['total_sms'] / k:>6.2f} " + " ".join(f"{c:>28}" for c in cells))
    iso = result.get("isolation")
    if isinstance(iso, dict) and "error" not in iso:
        print(f"\ndecode-like step per iteration, split {iso['split']} (p50 / p99 ms)")
        for key, val in iso.items():
            if isinstance(val, dict):
                print(f"  {key:32s} {val['p50_ms']:8.3f} / {val['p99_ms']:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--isolation-split", type=int, default=64, help="prefill SMs of the isolation test's split")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sm_partition_scaling.py measures a GPU: no CUDA device here")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__}
    try:
        import cuda.bindings as cb

        result["cuda_bindings"] = getattr(cb, "__version__", "?")
    except ImportError:
        result["cuda_bindings"] = None
    t0 = time.perf_counter()
    from hybridserve.engine.green_contexts import GreenContextDriver

    driver = GreenContextDriver.open(torch.device("cuda", 0))
    g, total = driver.granularity, driver.total_sms
    menu = tuple(k for k in MENU if -(-k // g) * g <= total - g)
    part = open_partitioner(torch.device("cuda", 0), menu, min_lane_groups=1)
    result.update(total_sms=part.total_sms, granularity=part.granularity, splits=[str(s) for s in part.splits],
                  open_s=round(time.perf_counter() - t0, 3))
    print(part.describe(), flush=True)
    probe = SmProbe()
    section(result, "placement", lambda: placement(part, probe))
    try:
        work = make_work()
    except Exception as err:  # noqa: BLE001 - the sections that need no inputs still run
        result["work_error"] = repr(err)
        work = None
    if work is not None:
        section(result, "scaling", lambda: scaling(part, work))
        split = part.nearest(args.isolation_split)
        section(result, "isolation", lambda: isolation(part, work, split))
        section(result, "graphs", lambda: graphs(part, work, probe))
    section(result, "allocator", lambda: allocator(part))
    section(result, "torch_green_contexts", lambda: torch_green_contexts(probe))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
