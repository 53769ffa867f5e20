"""Router overhead and prefix-index accuracy.

1. Overhead: a stub decode worker (answers GenerateLocal at once, no model) behind the router, which runs
   in its own process. An open-loop client sends requests at increasing rates (Poisson arrivals) straight to
   the stub over gRPC, then through the router's gRPC door and its HTTP (OpenAI) door; the added latency is
   the router path's percentile minus the direct path's.
2. Index accuracy: tiny real workers (2 prefill + 2 decode) on a shared-prefix workload; for each request
   the index's predicted checkpointed hit on the chosen worker vs the cached tokens that worker reported.

    python bench/router_overhead.py --out bench/results/cpu/router_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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

from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc

PROMPT = list(range(10, 74))  # 64 tokens
MAX_TOKENS = 4


class StubDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Answers like a decode worker that generates instantly; caches nothing."""

    def GenerateLocal(self, request, context):  # noqa: N802
        n = request.sampling.max_tokens or 16
        for i in range(n):
            yield common_pb2.TokenEvent(request_id=request.request_id, token_ids=[65 + i % 26],
                                        finish_reason="length" if i == n - 1 else "",
                                        num_prompt_tokens=len(request.prompt_token_ids))

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="decode", block_size=16, state_block=32,
                                         total_state_slots=1024, free_state_slots=1024, max_model_len=4096)

    def CacheEvents(self, request, context):  # noqa: N802
        yield common_pb2.CacheEventBatch(worker_id="stub", snapshot=True)
        while context.is_active():
            time.sleep(0.2)

    def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(found=False)


def _serve_router(model_dir: str, queue) -> None:
    """Child process: the stub worker and the router over it, until killed."""
    from hybridserve.router.app import Router, RouterOptions
    from hybridserve.router.config import AdmissionConfig

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(StubDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub_address = f"127.0.0.1:{port}"
    options = RouterOptions(model_dir, model_name="bench", http_port=0, grpc_port=0, max_model_len=4096,
                            admission=AdmissionConfig(max_running=1024, max_queued=4096))
    router = Router(options, [], [stub_address]).start()
    time.sleep(1.0)  # first health poll and event snapshot
    queue.put((stub_address, router.grpc_address, router.http_address))
    threading.Event().wait()


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


def overhead(model_dir: str, rates: list[float], duration_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_serve_router, args=(model_dir, queue), daemon=True)
    child.start()
    try:
        stub_address, grpc_address, http_address = queue.get(timeout=120)
        direct = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(stub_address))
        routed = router_pb2_grpc.RouterStub(grpc.insecure_channel(grpc_address))
        sampling = common_pb2.SamplingOptions(max_tokens=MAX_TOKENS)
        from hybridserve.proto import worker_pb2

        def send_direct() -> None:
            list(direct.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=f"{random.getrandbits(64):x}", prompt_token_ids=PROMPT, sampling=sampling), timeout=30))

        def send_grpc() -> None:
            list(routed.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                                            sampling=sampling), timeout=30))

        body = {"model": "bench", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        for send in (send_direct, send_grpc):  # warm up connections and code paths
            for _ in range(20):
                send()
        rows = []
        for rate in rates:
            row = {"rate_rps": rate}
            for name, send in (("direct", send_direct), ("router_grpc", send_grpc)):
                row[name] = _percentiles(_open_loop(rate, duration_s, send))
            row["router_http"] = _percentiles(_open_loop_async(rate, duration_s, f"http://{http_address}", body))
            for path in ("router_grpc", "router_http"):
                row[f"{path}_added"] = {q: round(row[path][q] - row["direct"][q], 3) for q in ("p50_ms", "p99_ms")}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        child.kill()


def index_accuracy(model_dir: str, systems: int, users: int) -> dict:
    """Shared-prefix workload on real tiny workers: predicted vs reported cached tokens per request."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "router"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="25,50,100,200", help="requests/s, comma-separated")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per rate and path")
    parser.add_argument("--systems", type=int, default=4, help="shared prefixes in the accuracy workload")
    parser.add_argument("--users", type=int, default=5, help="requests per shared prefix")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "router"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from router_cluster import tiny_model_dir

    model_dir = tiny_model_dir()
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": mp.cpu_count()},
        "workload": {"prompt_tokens": len(PROMPT), "max_tokens": MAX_TOKENS, "duration_s": args.duration},
        "overhead": overhead(str(model_dir), [float(r) for r in args.rates.split(",")], args.duration),
        "index_accuracy": index_accuracy(str(model_dir), args.systems, args.users),
    }
    print(json.dumps(result["index_accuracy"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
