"""Attacks under load: while greedy streams run, big grammars (refused by size, or compiled off the engine
loop), malformed and hostile inputs on both doors, slow and silent connections, foreign aborts and client
disconnects. The streams' tokens are exactly those of a quiet run, and their inter-token gaps stay bounded:
each engine step is slowed to STEP_S so that a stalled loop shows as a gap of many steps, not as CPU noise."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import grpc
import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

STEP_S = 0.15  # added to each engine step (a 1.4 MB body costs the shared GIL up to ~0.4 s of C-level JSON work)
# the largest inter-token gap of any stream, over the median gap of all: a stall (the compile on the loop) is
# tens of median gaps; 3x held locally but measured 3.1x once on the 2-core CI box (its one process shares a GIL
# with the attacks' body parsing), so the bound leaves room for that noise and still catches a stall
GAP_RATIO = 5.0
# the streams' gaps are compared with each other: run by itself, not beside other tests' load (pyproject markers)
pytestmark = pytest.mark.alone
ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=32, max_model_len=256, grammar_compile_timeout_s=5.0)
TOKENS = 40


def objects_schema(objects: int, properties: int) -> dict:
    inner = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)},
             "required": [f"p{j}" for j in range(properties)]}
    return {"type": "object", "properties": {f"o{i}": inner for i in range(objects)},
            "required": [f"o{i}" for i in range(objects)]}


@pytest.fixture(scope="module")
def chaos(model_dir):
    c = Cluster(model_dir, num_prefill=0, num_decode=1, engine=ENGINE, header_timeout_s=1.0,
                first_byte_timeout_s=1.0)
    engine = c.decode[0].engine
    step = engine.step

    def slow_step(**kw):  # type: ignore[no-untyped-def]
        time.sleep(STEP_S)
        return step(**kw)

    engine.step = slow_step
    yield c
    c.stop()


class Streams:
    """`count` greedy gRPC streams, each recording its tokens and the times their events arrived."""

    def __init__(self, cluster: Cluster, count: int) -> None:
        assert cluster.router is not None
        self.channel = grpc.insecure_channel(cluster.router.grpc_address)
        stub = router_pb2_grpc.RouterStub(self.channel)
        params = sampling_to_proto(SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.times: list[list[float]] = [[] for _ in range(count)]
        self.errors: list[BaseException] = []

        def run(i: int) -> None:
            request = router_pb2.GenerateRequest(text=f"stream {i} says", sampling=params)
            try:
                for response in stub.Generate(request, timeout=120):
                    self.tokens[i] += list(response.event.token_ids)
                    self.times[i].append(time.monotonic())
            except grpc.RpcError as exc:
                self.errors.append(exc)

        self.threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def started(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(len(t) >= 3 for t in self.times) and time.monotonic() < deadline:
            time.sleep(0.01)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)
        self.channel.close()

    def gaps(self) -> tuple[float, float]:
        """(median, largest) gap between a stream's events after its first two (admission and prefill)."""
        gaps = [b - a for t in self.times for a, b in zip(t[2:], t[3:])]
        return statistics.median(gaps), max(gaps)


def quiet_run(cluster: Cluster, count: int) -> list[list[int]]:
    streams = Streams(cluster, count)
    streams.join()
    assert not streams.errors
    return streams.tokens


def post(cluster: Cluster, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(cluster.base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60)


def check_streams(streams: Streams, expected: list[list[int]]) -> None:
    streams.join()
    assert not streams.errors
    assert streams.tokens == expected  # exact, under attack
    median, largest = streams.gaps()
    assert largest < GAP_RATIO * median, f"a stream stalled: largest gap {largest:.3f} s, median {median:.3f} s"


def test_big_grammars_do_not_stall_other_streams(chaos: Cluster) -> None:
    expected = quiet_run(chaos, 8)
    streams = Streams(chaos, 8)
    streams.started()
    start = time.monotonic()
    for objects in (600, 2000):  # the attack's schemas: refused by their size at once, never compiled
        answer = post(chaos, {"model": MODEL_NAME, "prompt": "{", "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": objects_schema(objects, 20)}}})
        assert answer.status_code == 400 and "this server compiles at most" in answer.json()["error"]["message"]
    assert time.monotonic() - start < 10
    bomb = post(chaos, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "guided_regex": "((a{100}){100}){100}"})
    assert bomb.status_code == 400 and "states" in bomb.json()["error"]["message"]
    # within the limits: >= 1 s of compiling (25+ engine steps) on a low-priority pool thread while the streams
    # go on; its answer once compiled, or a 400 at the deadline when the busy CPU did not get to it in time
    sent = time.monotonic()
    within = post(chaos, {"model": MODEL_NAME, "prompt": "{", "max_tokens": 4, "temperature": 0,
                          "guided_json": objects_schema(95, 20)})
    assert within.status_code == 200 or "did not compile within 5 s" in within.json()["error"]["message"], within.text
    assert time.monotonic() - sent < ENGINE.grammar_compile_timeout_s + 5
    check_streams(streams, expected)


def slow_connection(cluster: Cluster, trickle: bool) -> threading.Thread:
    """A connection that sends nothing or its headers a byte every 0.2 s; returns the thread holding it."""
    assert cluster.router is not None
    host, port = cluster.router.http_address.rsplit(":", 1)

    def hold() -> None:
        sock = socket.create_connection((host, int(port)))
        sock.settimeout(0.2)
        data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 100 if trickle else b""
        deadline = time.monotonic() + 8
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
            if time.monotonic() > deadline:
                raise AssertionError("the slow connection was not closed")
        sock.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


def test_sixteen_streams_stay_exact_and_smooth_under_attack(chaos: Cluster) -> None:
    assert chaos.router is not None
    expected = quiet_run(chaos, 16)
    streams = Streams(chaos, 16)
    streams.started()
    slow = [slow_connection(chaos, trickle=i % 2 == 0) for i in range(10)]
    hostile: list[tuple[dict | bytes, int]] = [
        (b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        (b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "a\\ud800b"}', 400),
        (b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "x", "temperature": Infinity}', 400),
        ({"model": MODEL_NAME, "prompt": "x", "stop": ["s"] * 5}, 400),
        ({"model": MODEL_NAME, "prompt": "{", "guided_json": objects_schema(600, 20)}, 400),
    ]
    for body, status in hostile:
        assert post(chaos, body).status_code == status
    assert httpx.get(chaos.base_url + "/v1/nope", timeout=10).json()["error"]["code"] == "not_found"
    channel = grpc.insecure_channel(chaos.router.grpc_address)
    stub = router_pb2_grpc.RouterStub(channel)
    for sampling in (common_pb2.SamplingOptions(max_tokens=4, temperature=float("inf")),
                     common_pb2.SamplingOptions(max_tokens=4, stop=["x"] * 10_000),
                     common_pb2.SamplingOptions(max_tokens=0)):
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(router_pb2.GenerateRequest(text="x", sampling=sampling), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(router_pb2.GenerateRequest(request_id="i" * (1 << 20), text="x"), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    raw = channel.unary_stream("/hybridserve.v1.Router/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        list(raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not stub.Abort(common_pb2.AbortRequest(request_id="someone-elses"), timeout=10).found
    for _ in range(4):  # clients that leave mid-stream
        call = stub.Generate(router_pb2.GenerateRequest(text="leaving", sampling=sampling_to_proto(
            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))), timeout=60)
        next(call)
        call.cancel()
    channel.close()
    for thread in slow:
        thread.join(15)
        assert not thread.is_alive()
    check_streams(streams, expected)
    assert chaos.idle(timeout=10)
