"""Router overhead and prefix-index accuracy.

1. Overhead: a stub decode worker (answers GenerateLocal at once, no model) behind the router, each in its
   own process. An open-loop client sends requests at increasing rates (Poisson arrivals) straight to the
   stub over gRPC, then through the router's gRPC door and its HTTP (OpenAI) door, `--repeats` interleaved
   runs each; the added latency is the median over runs of the router path's percentile minus the direct
   path's; for the HTTP paths also minus "direct_http" (`*_added_vs_http`: the same client against an HTTP
   server that answers in place, `router_floor.serve_direct_http`). Also the router process's CPU time per
   request, and the per-token cost of streaming: the added
   p50 of `--stream-tokens`-token requests minus that of 4-token ones, per extra token. The router sends local
   requests on its session with the worker (one stream for all of them: the stub's socket session, as a decode
   worker's; "*_over_grpc" a router whose session is a gRPC stream); "router_grpc_calls" is a second router
   over a stub without sessions (a GenerateLocal call per request, as before sessions). The same runs also go
   through a bare proxy with the router's transport stack and none of its logic (`bench/serving/router_floor.py`:
   "floor_grpc", "floor_http", with the proxy process's CPU per request): the floor no router change removes.
2. Index accuracy: tiny real workers (2 prefill + 2 decode) on a shared-prefix workload; for each request
   the index's predicted checkpointed hit on the chosen worker vs the cached tokens that worker reported.

    python bench/serving/router_overhead.py --out bench/results/cpu/router/router_overhead.json
    # the short run (~2.5 min): 100 req/s, the streaming row as before (68 tokens at 20/s), no accuracy workload
    python bench/serving/router_overhead.py --rates 100 --duration 2.5 --repeats 3 --no-accuracy \
        --out router_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from router_stub import MAX_TOKENS, PROMPT, cpu_seconds, serve_router, serve_stub

from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


def _open_loop(rate: float, duration_s: float, send) -> list[float]:
    """Poisson arrivals at `rate`/s for `duration_s`; each `send()` runs on a thread; returns latencies (s)."""
    latencies: list[float] = []
    lock = threading.Lock()
    pool = futures.ThreadPoolExecutor(max_workers=256)

    def one() -> None:
        start = time.perf_counter()
        send()
        with lock:
            latencies.append(time.perf_counter() - start)

    rng = random.Random(0)
    end = time.perf_counter() + duration_s
    next_at = time.perf_counter()
    jobs = []
    while next_at < end:
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        jobs.append(pool.submit(one))
        next_at += rng.expovariate(rate)
    futures.wait(jobs)
    pool.shutdown()
    return latencies


def _open_loop_async(rate: float, duration_s: float, base_url: str, body: dict) -> list[float]:
    """Poisson arrivals of HTTP POSTs from one asyncio client (cheaper per request than threads)."""

    async def run() -> list[float]:
        latencies: list[float] = []
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
            async def one() -> None:
                start = time.perf_counter()
                (await client.post("/v1/completions", json=body)).raise_for_status()
                latencies.append(time.perf_counter() - start)

            for _ in range(20):
                await one()
            latencies.clear()
            rng = random.Random(0)
            end = time.perf_counter() + duration_s
            next_at, tasks = time.perf_counter(), []
            while next_at < end:
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                tasks.append(asyncio.create_task(one()))
                next_at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        return latencies

    return asyncio.run(run())


def _percentiles(xs: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(xs, n=100, method="inclusive")
    return {"p50_ms": round(qs[49] * 1e3, 3), "p99_ms": round(qs[98] * 1e3, 3), "n": len(xs)}


def _median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-key median over repeated runs of one path."""
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def overhead(model_dir: str, rates: list[float], duration_s: float, repeats: int, stream_tokens: int,
             stream_rate: float, floor: bool = True, calls: bool = True,
             grpc_sessions: bool = True) -> tuple[list[dict], dict]:
    """Added latency per rate (median over `repeats` interleaved runs of each path) and the per-token cost of
    streaming (`stream_tokens` per request at `stream_rate` vs MAX_TOKENS at the same rate). With `calls`,
    also "router_grpc_calls": a second router over a stub that offers no sessions (a GenerateLocal call per
    request, as before sessions). With `grpc_sessions`, also "router_grpc_over_grpc" / "router_http_over_grpc": a
    router over the same stub whose sessions go over gRPC streams instead of the stub's socket session."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    stub = ctx.Process(target=serve_stub, args=(queue,), daemon=True)
    stub.start()
    router = proxy = plain_stub = plain_router = direct_http = grpc_router = None
    try:
        stub_address = queue.get(timeout=120)
        router = ctx.Process(target=serve_router, args=(model_dir, stub_address, queue), daemon=True)
        router.start()
        grpc_address, http_address = queue.get(timeout=120)
        if grpc_sessions:
            grpc_router = ctx.Process(target=serve_router, args=(model_dir, stub_address, queue, False), daemon=True)
            grpc_router.start()
            over_grpc_address, over_grpc_http_address = queue.get(timeout=120)
            routed_over_grpc = router_pb2_grpc.RouterStub(grpc.insecure_channel(over_grpc_address))
        if calls:
            plain_stub = ctx.Process(target=serve_stub, args=(queue, False), daemon=True)
            plain_stub.start()
            plain_stub_address = queue.get(timeout=120)
            plain_router = ctx.Process(target=serve_router, args=(model_dir, plain_stub_address, queue), daemon=True)
            plain_router.start()
            plain_grpc_address, _ = queue.get(timeout=120)
            routed_calls = router_pb2_grpc.RouterStub(grpc.insecure_channel(plain_grpc_address))
        if floor:
            from router_floor import serve_floor

            proxy = ctx.Process(target=serve_floor, args=(stub_address, queue), daemon=True)
            proxy.start()
            floor_grpc_address, floor_http_address = queue.get(timeout=120)
            floored = router_pb2_grpc.RouterStub(grpc.insecure_channel(floor_grpc_address))
        from router_floor import serve_direct_http

        direct_http = ctx.Process(target=serve_direct_http, args=(queue,), daemon=True)
        direct_http.start()
        direct_http_address = queue.get(timeout=120)
        direct = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(stub_address))
        routed = router_pb2_grpc.RouterStub(grpc.insecure_channel(grpc_address))
        pids = {"router_grpc": router.pid, "router_http": router.pid}
        if plain_router is not None:
            pids["router_grpc_calls"] = plain_router.pid
        if grpc_router is not None:
            pids.update(router_grpc_over_grpc=grpc_router.pid, router_http_over_grpc=grpc_router.pid)
        if proxy is not None:
            pids.update(floor_grpc=proxy.pid, floor_http=proxy.pid)
        def paths(max_tokens: int) -> dict:
            sampling = common_pb2.SamplingOptions(max_tokens=max_tokens)
            body = {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens}

            def send_direct() -> None:
                list(direct.GenerateLocal(worker_pb2.GenerateLocalRequest(
                    request_id=f"{random.getrandbits(64):x}", prompt_token_ids=PROMPT, sampling=sampling), timeout=30))

            def send_grpc() -> None:
                list(routed.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                                                sampling=sampling), timeout=30))

            ways = {"direct": lambda rate: _open_loop(rate, duration_s, send_direct),
                    "direct_http": lambda rate: _open_loop_async(rate, duration_s, f"http://{direct_http_address}",
                                                                 body),
                    "router_grpc": lambda rate: _open_loop(rate, duration_s, send_grpc),
                    "router_http": lambda rate: _open_loop_async(rate, duration_s, f"http://{http_address}", body),
                    "_warm": (send_direct, send_grpc)}
            if grpc_router is not None:
                def send_over_grpc() -> None:
                    list(routed_over_grpc.Generate(router_pb2.GenerateRequest(
                        token_ids=router_pb2.TokenIds(ids=PROMPT), sampling=sampling), timeout=30))

                ways.update(router_grpc_over_grpc=lambda rate: _open_loop(rate, duration_s, send_over_grpc),
                            router_http_over_grpc=lambda rate: _open_loop_async(
                                rate, duration_s, f"http://{over_grpc_http_address}", body),
                            _warm=(*ways["_warm"], send_over_grpc))
            if plain_router is not None:
                def send_calls() -> None:
                    list(routed_calls.Generate(router_pb2.GenerateRequest(
                        token_ids=router_pb2.TokenIds(ids=PROMPT), sampling=sampling), timeout=30))

                ways.update(router_grpc_calls=lambda rate: _open_loop(rate, duration_s, send_calls),
                            _warm=(*ways["_warm"], send_calls))
            if proxy is not None:
                def send_floor() -> None:
                    list(floored.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                                                     sampling=sampling), timeout=30))

                ways.update(floor_grpc=lambda rate: _open_loop(rate, duration_s, send_floor),
                            floor_http=lambda rate: _open_loop_async(rate, duration_s, f"http://{floor_http_address}",
                                                                     body),
                            _warm=(*ways["_warm"], send_floor))
            return ways

        def measure(rate: float, max_tokens: int) -> dict:
            runs: dict[str, list[dict]] = {}
            ways = paths(max_tokens)
            for send in ways.pop("_warm"):  # warm up connections and code paths
                for _ in range(20):
                    send()
            for _ in range(repeats):
                for name, run in ways.items():
                    pid = pids.get(name)  # the router's (or the floor proxy's) own CPU time; the stub has its own
                    cpu = cpu_seconds(pid) if pid else 0.0
                    latencies = run(rate)
                    row = _percentiles(latencies)
                    if pid:
                        key = "router_cpu_ms_per_request" if name.startswith("router") else "floor_cpu_ms_per_request"
                        row[key] = round((cpu_seconds(pid) - cpu) / len(latencies) * 1e3, 3)
                    runs.setdefault(name, []).append(row)
            row = {"rate_rps": rate, "max_tokens": max_tokens, "repeats": repeats}
            row.update({name: _median_row(r) for name, r in runs.items()})
            for path in (p for p in runs if not p.startswith("direct")):
                row[f"{path}_added"] = {q: round(statistics.median(
                    r[q] - d[q] for r, d in zip(runs[path], runs["direct"])), 3) for q in ("p50_ms", "p99_ms")}
                if path.endswith("_http"):  # HTTP to HTTP: the client's protocol cost cancels
                    row[f"{path}_added_vs_http"] = {q: round(statistics.median(
                        r[q] - d[q] for r, d in zip(runs[path], runs["direct_http"])), 3) for q in ("p50_ms", "p99_ms")}
            print(json.dumps(row), flush=True)
            return row

        rows = [measure(rate, MAX_TOKENS) for rate in rates]
        short = next((r for r in rows if r["rate_rps"] == stream_rate), None) or measure(stream_rate, MAX_TOKENS)
        long = measure(stream_rate, stream_tokens)
        per_token = {f"{path}_added_us_per_token": round(
            (long[f"{path}_added"]["p50_ms"] - short[f"{path}_added"]["p50_ms"]) / (stream_tokens - MAX_TOKENS) * 1e3, 1)
            for path in ("router_grpc", "router_grpc_calls", "router_http", "router_grpc_over_grpc",
                         "router_http_over_grpc", "floor_grpc", "floor_http")
            if f"{path}_added" in long}
        streaming = {"rate_rps": stream_rate, "tokens": [MAX_TOKENS, stream_tokens], "long": long, **per_token}
        print(json.dumps(per_token), flush=True)
        return rows, streaming
    finally:
        for child in (proxy, router, stub, plain_router, plain_stub, direct_http, grpc_router):
            if child is not None:
                child.kill()


def index_accuracy(model_dir: str, systems: int, users: int) -> dict:
    """Shared-prefix workload on real tiny workers: predicted vs reported cached tokens per request."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "router"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from router_cluster import Cluster  # the test cluster: in-process workers + router

    from hybridserve import SamplingParams

    cluster = Cluster(Path(model_dir), num_prefill=2, num_decode=2)
    rng = random.Random(1)
    prompt_tokens = predicted = reported = exact = n = 0
    try:
        orchestrator = cluster.router.orchestrator
        prefixes = [[rng.randrange(3, 300) for _ in range(96)] for _ in range(systems)]
        for u in range(users):
            for s, prefix in enumerate(prefixes):
                prompt = prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(8, 40))]
                rid = f"acc-{u}-{s}"
                events = list(orchestrator.generate(prompt, SamplingParams(max_tokens=2, temperature=0), rid))
                decision = dict(orchestrator.recent_decisions)[rid]
                cached = events[-1].num_cached_tokens
                prompt_tokens += len(prompt)
                predicted += decision.predicted_cached_tokens
                reported += cached
                exact += decision.predicted_cached_tokens == cached
                n += 1
                time.sleep(0.1)  # let the cache events of this request reach the index
    finally:
        cluster.stop()
    return {"requests": n, "prompt_tokens": prompt_tokens, "index_hit_ratio": round(predicted / prompt_tokens, 4),
            "worker_hit_ratio": round(reported / prompt_tokens, 4), "exact_prediction_fraction": round(exact / n, 4)}


def _cpu_model() -> str:
    """The host CPU's model name (Linux), so results from different hosts are not compared by mistake."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="25,50,100,200", help="requests/s, comma-separated")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per rate and path")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per rate and path (median)")
    parser.add_argument("--stream-tokens", type=int, default=68, help="tokens per request of the streaming row")
    parser.add_argument("--stream-rate", type=float, default=20.0, help="requests/s of the streaming row")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the index-accuracy workload")
    parser.add_argument("--no-floor", action="store_true", help="skip the bare-proxy floor paths")
    parser.add_argument("--no-calls", action="store_true",
                        help="skip the router over a stub without sessions (a GenerateLocal call per request)")
    parser.add_argument("--no-grpc-sessions", action="store_true",
                        help="skip the router whose sessions with the stub go over gRPC streams (not its socket)")
    parser.add_argument("--systems", type=int, default=4, help="shared prefixes in the accuracy workload")
    parser.add_argument("--users", type=int, default=5, help="requests per shared prefix")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "router"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # router_floor, for the spawned floor process
    from router_cluster import tiny_model_dir

    model_dir = tiny_model_dir()
    rows, streaming = overhead(str(model_dir), [float(r) for r in args.rates.split(",")], args.duration, args.repeats,
                               args.stream_tokens, args.stream_rate, floor=not args.no_floor, calls=not args.no_calls,
                               grpc_sessions=not args.no_grpc_sessions)
    result = {
        "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "python": platform.python_version(),
                    "cpus": mp.cpu_count(),
                    "load_average": os.getloadavg()},
        "versions": {"grpcio": grpc.__version__, "uvicorn": _version("uvicorn"), "uvloop": _version("uvloop")},
        "workload": {"prompt_tokens": len(PROMPT), "max_tokens": MAX_TOKENS, "duration_s": args.duration,
                     "repeats": args.repeats},
        "overhead": rows,
        "streaming": streaming,
    }
    if not args.no_accuracy:
        result["index_accuracy"] = index_accuracy(str(model_dir), args.systems, args.users)
        print(json.dumps(result["index_accuracy"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
