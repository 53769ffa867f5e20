"""Attacks under load: while greedy streams run, big grammars (refused by size, or compiled off the engine
loop), malformed and hostile inputs on both doors, slow and silent connections, foreign aborts and client
disconnects. The streams' tokens are exactly those of a quiet run. Nothing here is timed: that a grammar compiles
off the loop is shown by the loop's own step count advancing while the compile is held open (each engine step is
slowed to STEP_S so that the attacks land while the streams run)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import grpc
import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve import SamplingParams
from hybridserve.common.sampling_params import StructuredOutput
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

STEP_S = 0.15  # added to each engine step
ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=32, max_model_len=256, grammar_compile_timeout_s=5.0)
TOKENS = 40
STEPS_DURING_COMPILE = 3  # engine steps the held compile waits for: none come when the compile blocks the loop


def objects_schema(objects: int, properties: int) -> dict:
    inner = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)},
             "required": [f"p{j}" for j in range(properties)]}
    return {"type": "object", "properties": {f"o{i}": inner for i in range(objects)},
            "required": [f"o{i}" for i in range(objects)]}


class LoopWatch:
    """The decode engine's step count and the thread its loop runs on, kept by the slowed step."""

    def __init__(self) -> None:
        self.steps = 0
        self.thread: int | None = None

    def wait_for_steps(self, count: int, limit_s: float) -> int:
        """Wait until `count` more steps ran (or `limit_s` passed: a guard, not a measure); the steps seen."""
        first = self.steps
        deadline = time.monotonic() + limit_s
        while self.steps < first + count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.steps - first


@pytest.fixture(scope="module")
def chaos(model_dir):
    c = Cluster(model_dir, num_prefill=0, num_decode=1, engine=ENGINE, header_timeout_s=1.0,
                first_byte_timeout_s=1.0)
    engine = c.decode[0].engine
    step = engine.step
    watch = LoopWatch()

    def slow_step(**kw):  # type: ignore[no-untyped-def]
        time.sleep(STEP_S)
        watch.thread = threading.get_ident()
        watch.steps += 1
        return step(**kw)

    engine.step = slow_step
    c.loop_watch = watch  # type: ignore[attr-defined]
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


def test_big_grammars_do_not_stall_other_streams(chaos: Cluster) -> None:
    watch: LoopWatch = chaos.loop_watch  # type: ignore[attr-defined]
    pool = chaos.decode[0].engine.grammars.backend().pool
    compile_fn = pool._compile_fn
    compiles: list[tuple[int, int]] = []  # (thread, engine steps while this compile was held open)

    def held_compile(spec: StructuredOutput) -> Any:
        compiles.append((threading.get_ident(), watch.wait_for_steps(STEPS_DURING_COMPILE, limit_s=4.0)))
        return compile_fn(spec)

    pool._compile_fn = held_compile
    try:
        expected = quiet_run(chaos, 8)
        streams = Streams(chaos, 8)
        streams.started()
        refused = pool.num_refused
        # within the limits, sent first so that its compile is held while the streams run: compiled on a pool
        # thread while the engine steps; its answer once compiled, or a 400 at the deadline when the busy CPU did
        # not get to it in time
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(post(chaos, {
            "model": MODEL_NAME, "prompt": "{", "max_tokens": 4, "temperature": 0,
            "guided_json": objects_schema(95, 20)})))
        sender.start()
        for objects in (600, 2000):  # the attack's schemas: refused by their size, never compiled
            answer = post(chaos, {"model": MODEL_NAME, "prompt": "{", "max_tokens": 8, "response_format": {
                "type": "json_schema", "json_schema": {"name": "big", "schema": objects_schema(objects, 20)}}})
            assert answer.status_code == 400 and "this server compiles at most" in answer.json()["error"]["message"]
        bomb = post(chaos, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4,
                            "guided_regex": "((a{100}){100}){100}"})
        assert bomb.status_code == 400 and "states" in bomb.json()["error"]["message"]
        sender.join(60)
        assert answers, "the compilable request raised in its thread (see the thread's exception above)"
        (within,) = answers
        message = within.json()["error"]["message"] if within.status_code != 200 else ""
        assert within.status_code == 200 or "did not compile within 5 s" in message, within.text
        check_streams(streams, expected)
    finally:
        pool._compile_fn = compile_fn
    assert pool.num_refused == refused + 3  # the refused three never reached the compiler: one compile ran
    assert len(compiles) == 1
    thread, steps = compiles[0]
    assert thread != watch.thread, "the grammar compiled on the engine loop's thread"
    assert steps >= STEPS_DURING_COMPILE, "the engine loop did not step while a grammar compiled"


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


def test_sixteen_streams_stay_exact_under_attack(chaos: Cluster) -> None:
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
