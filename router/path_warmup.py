"""Before the router reports ready, one tiny request (a one-token prompt, one output token) through each of its open
doors, end to end: HTTP parsing and validation, routing, the first session to a worker, the worker's request path,
the stream back. Each of those does first-time work (lazy imports, first validation of a pydantic model, opening
a session socket): served on the H200 the first request after ready took 1.5-1.65x the last one although the engine
itself was warm (bench/results/h200/serving/); on the 2-core CPU box the first HTTP request came
back 67 ms slower than the next. A door that fails its warm-up is logged and left cold: readiness is not held back
by it (the workers' own health decides that)."""

from __future__ import annotations

import http.client
import json
import logging
import time

import grpc

from hybridserve.proto import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 30.0
WARMUP_SETTLE_S = 2.0  # after the warm-up requests: how long the router waits for their bookkeeping to end
WARMUP_TOKEN = 0  # any id in the vocabulary: the prompt is one token, the reply one token


def _local(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), int(port)


def warm_http(address: str, model: str, api_key: str | None, timeout_s: float = WARMUP_TIMEOUT_S) -> float:
    """A streamed one-token completion through the HTTP door at `address`; returns its milliseconds."""
    host, port = _local(address)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        body = json.dumps({"model": model, "prompt": [WARMUP_TOKEN], "max_tokens": 1, "stream": True})
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        text = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {text[:200]!r}")
    finally:
        conn.close()
    return 1e3 * (time.perf_counter() - start)


def warm_grpc(address: str, api_key: str | None, timeout_s: float = WARMUP_TIMEOUT_S) -> float:
    """A one-token Generate through the gRPC door at `address`; returns its milliseconds."""
    host, port = _local(address)
    start = time.perf_counter()
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 literal needs its brackets
    with grpc.insecure_channel(target) as channel:
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[WARMUP_TOKEN]))
        request.sampling.max_tokens = 1
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        for _ in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s, metadata=metadata):
            pass
    return 1e3 * (time.perf_counter() - start)


def warm_serving_path(http_address: str | None, grpc_address: str | None, model: str,
                      api_key: str | None) -> dict[str, float]:
    """Warm each open door (module docstring); returns door -> milliseconds of the ones that answered."""
    took: dict[str, float] = {}
    doors = [("http", http_address, lambda a: warm_http(a, model, api_key)),
             ("grpc", grpc_address, lambda a: warm_grpc(a, api_key))]
    for door, address, warm in doors:
        if address is None:
            continue
        try:
            took[door] = warm(address)
        except Exception as exc:  # noqa: BLE001 - a cold door still serves; its first request pays instead
            logger.warning("warming the %s door at %s failed (its first request pays the first-time work): %s",
                           door, address, exc)
    if took:
        logger.info("serving path warmed: %s", ", ".join(f"{d} {ms:.0f} ms" for d, ms in took.items()))
    return took
