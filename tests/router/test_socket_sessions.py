"""Socket sessions (worker_runtime/session_socket.py, router/session_socket.py): the router's requests over a
decode worker's plain-TCP session give the offline engine's tokens (local and prefilled elsewhere); the hello
checks the token and the version; a peer speaking garbage is cut off without harming the worker; a worker
whose socket cannot be reached is served over the gRPC session instead."""

from __future__ import annotations

import socket
import struct
import time
from concurrent import futures

import grpc
import pytest
from checkpoints import random_prompts
from router_cluster import GREEDY, Cluster

from hybridserve.engine.llm import LLM
from hybridserve.proto import worker_pb2
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.proto.session_frames import MAX_HELLO_BYTES, VERSION, encode, parse, recv_frame
from hybridserve.router.config import OrchestratorConfig
from hybridserve.router.session_socket import SocketSessionCall

TOKEN = "a-test-internal-token-0123"


def _offline(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in LLM(model_dir, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                             sampling_params=GREEDY)]


def _connect(port: int, token: str = TOKEN, version: int = VERSION) -> tuple[socket.socket, worker_pb2.SessionHelloReply]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(encode(worker_pb2.SessionHello(token=token, version=version)))
    payload = recv_frame(sock)
    assert payload is not None
    return sock, parse(worker_pb2.SessionHelloReply, payload)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def cluster(model_dir):
    # prompts up to 16 tokens prefill on the decode worker, longer ones on the prefill worker
    c = Cluster(model_dir, num_prefill=1, num_decode=1, router=False, internal_token=TOKEN,
                config=OrchestratorConfig(local_prefill_max_tokens=16))
    c.wait_ready()
    yield c
    c.stop()


def test_local_and_disaggregated_requests_over_the_socket_session_equal_the_offline_engine(cluster, model_dir) -> None:
    prompts = random_prompts([3, 9, 17, 31, 40, 57], vocab=300, seed=81)  # the longer ones prefill remotely
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(cluster.generate, prompts))
    assert got == _offline(model_dir, prompts)
    handle = cluster.orchestrator.workers.snapshot()[1][0]
    assert handle.health.session_port == cluster.decode[0].health().session_port > 0
    session = handle._session
    assert session is not None and isinstance(session._call, SocketSessionCall) and not session._streams
    decisions = [d for _, d in cluster.orchestrator.recent_decisions]
    assert any(d.local for d in decisions) and any(not d.local for d in decisions)  # both kinds went over it
    assert cluster.idle()
    cluster.check_pools()


def test_the_hello_checks_token_and_version_and_a_raw_client_gets_the_calls_tokens(cluster, model_dir) -> None:
    port = cluster.decode[0].health().session_port
    for token, version, code in ((TOKEN[:-1] + "x", VERSION, grpc.StatusCode.UNAUTHENTICATED),
                                 ("", VERSION, grpc.StatusCode.UNAUTHENTICATED),
                                 (TOKEN, VERSION + 1, grpc.StatusCode.FAILED_PRECONDITION)):
        sock, reply = _connect(port, token, version)
        assert reply.code == code.value[0] and reply.message
        assert sock.recv(1) == b""  # then the worker closed the connection
        sock.close()
    sock, reply = _connect(port)
    assert reply.code == 0
    prompt = [5, 6, 7, 8]
    sock.sendall(encode(worker_pb2.SessionRequest(generate=worker_pb2.GenerateLocalRequest(
        request_id="raw", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY)))))
    tokens: list[int] = []
    while True:
        events = parse(worker_pb2.SessionEvents, recv_frame(sock))
        tokens += [t for e in events.events for t in e.token_ids]
        if any(e.finish_reason for e in events.events):
            break
    sock.close()
    assert tokens == _offline(model_dir, [prompt])[0]


def test_garbage_and_a_vanished_router_change_nothing_on_the_worker(cluster) -> None:
    port = cluster.decode[0].health().session_port
    for header in (0xFFFFFFFF, MAX_HELLO_BYTES + 1):  # not a hello: larger than a hello may be, before any auth
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(struct.pack(">I", header) + b"GET / HTTP/1.1\r\n\r\n")
        assert sock.recv(1) == b""
        sock.close()
    sock, reply = _connect(port)
    sock.sendall(encode(worker_pb2.SessionRequest(generate=worker_pb2.GenerateLocalRequest(
        request_id="orphan", prompt_token_ids=[1, 2, 3],
        sampling=sampling_to_proto(GREEDY.__class__(max_tokens=10_000, temperature=0.0, ignore_eos=True))))))
    recv_frame(sock)  # running
    sock.close()  # the router vanished: its session's request is aborted on the worker
    assert cluster.idle()
    deadline = time.monotonic() + 10
    while cluster.decode[0].drain_state.in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.decode[0].drain_state.in_flight() == []
    assert len(cluster.generate([9, 10, 11])) == GREEDY.max_tokens  # and serves on
    cluster.check_pools()


def test_an_unreachable_socket_falls_back_to_the_grpc_session(model_dir) -> None:
    c = Cluster(model_dir, num_prefill=0, num_decode=1, router=False)
    try:
        c.wait_ready()
        c.decode[0]._session_sockets.stop()  # the port is closed (a firewall between router and worker, say)
        prompts = random_prompts([6, 12], vocab=300, seed=82)
        # no request fails for it: the first session's call hands what was written to it to a gRPC session
        assert [c.generate(p) for p in prompts] == _offline(model_dir, prompts)
        handle = c.orchestrator.workers.all()[0]
        assert handle._socket_retry_at > time.monotonic() and handle._session._call._delegate is not None
        c.orchestrator.loop.run(handle._session.close())  # the next session opens over gRPC straight away
        assert len(c.generate([7, 8])) == GREEDY.max_tokens
        assert not isinstance(handle._session._call, SocketSessionCall)
    finally:
        c.stop()


def test_socket_sessions_off_keeps_the_grpc_session(model_dir) -> None:
    from hybridserve.cli import build_parser
    from hybridserve.cli_options import cluster_options

    config = cluster_options(build_parser().parse_args(["serve", "--no-ray", "--no-socket-sessions"]))["router"]
    assert config.orchestrator.worker_socket_sessions is False and config.orchestrator.worker_sessions
    c = Cluster(model_dir, num_prefill=0, num_decode=1, router=False,
                config=OrchestratorConfig(worker_socket_sessions=False))
    try:
        c.wait_ready()
        assert len(c.generate([3, 4])) == GREEDY.max_tokens
        call = c.orchestrator.workers.all()[0]._session._call
        assert call is not None and not isinstance(call, SocketSessionCall)
    finally:
        c.stop()


def test_a_drained_worker_sends_its_last_events_before_its_sockets_close(model_dir) -> None:
    c = Cluster(model_dir, num_prefill=0, num_decode=1, router=False)
    worker = c.decode[0]
    try:
        c.wait_ready()
        step = worker.engine.step
        worker.engine.step = lambda **kw: (time.sleep(0.01), step(**kw))[1]  # type: ignore[method-assign]
        params = GREEDY.__class__(max_tokens=40, temperature=0.0, ignore_eos=True)
        events = c.orchestrator.generate([4, 5, 6], params)
        tokens = list(next(events).token_ids)
        assert worker.drain(60) == []  # the request finished in the drain
        worker.stop(grace=5)  # its session's last message (the finish) is still sent
        tokens += [t for event in events for t in event.token_ids]
        assert len(tokens) == 40
    finally:
        c.stop()


def test_connections_past_the_cap_are_closed_before_any_thread_or_hello(monkeypatch) -> None:
    from hybridserve.worker_runtime import session_socket

    def handler(requests, context):  # echoes nothing; holds the session until the peer leaves
        for _ in requests:
            pass
        return iter(())

    monkeypatch.setattr(session_socket, "MAX_CONNECTIONS", 1)
    server = session_socket.SessionSocketServer("127.0.0.1", 0, handler, TOKEN)
    port = server.start()
    try:
        first, reply = _connect(port)
        assert reply.code == 0
        second = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert second.recv(1) == b""  # closed at accept: no hello read, no thread
        second.close()
        first.close()
        deadline = time.monotonic() + 10
        while server._connections and time.monotonic() < deadline:
            time.sleep(0.01)
        third, reply = _connect(port)  # the first one's place is free again
        assert reply.code == 0
        third.close()
    finally:
        server.stop(grace_s=0)


def test_the_router_end_falls_back_on_junk_reports_a_broken_session_and_cancels_like_grpc() -> None:
    """SocketSessionCall against raw asyncio servers: a port that answers junk before any hello reply falls
    back (not INTERNAL for good); a session whose worker goes away ends UNAVAILABLE after the events that came;
    cancel() makes reads raise CancelledError, as a cancelled grpc.aio call's."""
    import asyncio

    from hybridserve.proto import common_pb2
    from hybridserve.router.worker_session import SessionError

    class _Fallback:
        def __init__(self) -> None:
            self.written: list = []

        async def write(self, request) -> None:
            self.written.append(request)

        async def read(self):
            return grpc.aio.EOF

        def cancel(self) -> bool:
            return True

        def done(self) -> bool:
            return True

    async def run() -> None:
        async def junk(reader, writer) -> None:
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n" * 4)
            await writer.drain()
            await reader.read(1 << 16)

        async def worker(reader, writer) -> None:  # accepts, takes a request, sends one event, then goes away
            await reader.read(1 << 10)
            writer.write(encode(worker_pb2.SessionHelloReply(code=0)))
            await writer.drain()
            await reader.read(1 << 10)
            writer.write(encode(worker_pb2.SessionEvents(events=[common_pb2.TokenEvent(request_id="a", token_ids=[7])])))
            await writer.drain()
            writer.close()

        async def holding(reader, writer) -> None:  # accepts and keeps the session open
            await reader.read(1 << 10)
            writer.write(encode(worker_pb2.SessionHelloReply(code=0)))
            await writer.drain()
            await reader.read(1 << 16)

        junk_server = await asyncio.start_server(junk, "127.0.0.1", 0)
        fallback, unreachable = _Fallback(), []
        call = SocketSessionCall("127.0.0.1", junk_server.sockets[0].getsockname()[1], None,
                                 fallback=lambda: fallback, on_unreachable=unreachable.append)
        request = worker_pb2.SessionRequest(abort=common_pb2.AbortRequest(request_id="x"))
        await call.write(request)
        assert fallback.written == [request] and unreachable[0].code() == grpc.StatusCode.UNAVAILABLE
        assert await call.read() is grpc.aio.EOF  # reads go to the fallback's call too
        junk_server.close()

        worker_server = await asyncio.start_server(worker, "127.0.0.1", 0)
        call = SocketSessionCall("127.0.0.1", worker_server.sockets[0].getsockname()[1], None)
        await call.write(request)
        assert [e.token_ids[0] for e in (await call.read()).events] == [7]
        with pytest.raises(SessionError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and call.done()
        worker_server.close()
        holding_server = await asyncio.start_server(holding, "127.0.0.1", 0)
        call = SocketSessionCall("127.0.0.1", holding_server.sockets[0].getsockname()[1], None)
        await call.write(request)
        assert call.cancel() and call.done()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        holding_server.close()

    asyncio.run(run())


def test_a_hello_reply_from_another_worker_is_refused_and_the_session_falls_back() -> None:
    """A remapped port (or a reused address) where another worker sharing the token answers: the router's
    end checks the worker id of the hello reply against the one it meant and falls back to gRPC."""
    import asyncio

    from hybridserve.proto import common_pb2
    from hybridserve.worker_runtime.session_socket import SessionSocketServer

    def handler(requests, context):
        for _ in requests:
            pass
        return iter(())

    server = SessionSocketServer("127.0.0.1", 0, handler, TOKEN, worker_id="decode-other")
    port = server.start()

    async def run() -> None:
        written: list = []

        class _Fallback:
            async def write(self, request) -> None:
                written.append(request)

        unreachable: list = []
        call = SocketSessionCall("127.0.0.1", port, TOKEN, fallback=_Fallback, on_unreachable=unreachable.append,
                                 worker_id="decode-meant")
        request = worker_pb2.SessionRequest(abort=common_pb2.AbortRequest(request_id="x"))
        await call.write(request)
        assert written == [request] and "decode-other" in unreachable[0].details()
        same = SocketSessionCall("127.0.0.1", port, TOKEN, worker_id="decode-other")  # the right one is served
        await same.write(request)
        assert same._delegate is None and not same.done()
        same.cancel()

    try:
        asyncio.run(run())
    finally:
        server.stop(grace_s=0)
