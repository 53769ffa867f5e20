"""Local requests over the router's session with a decode worker (one bidirectional stream for all of them):
tokens equal the offline engine's under concurrency; aborts, cuts of the session, stalled readers and deadlines
free everything on the worker; refusals keep their gRPC status; the worker's side batches and refuses by
request id when driven directly."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest
from checkpoints import nemotron_h, random_prompts
from router_cluster import GREEDY, Cluster

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm import LLM
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import insecure_channel
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.config import OrchestratorConfig, ResilienceConfig
from hybridserve.router.orchestrator import WorkerError

LONG = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def local(model_dir):
    c = Cluster(model_dir, num_prefill=0, num_decode=1, router=False)
    c.wait_ready()  # the worker's Health (which offers sessions) is in
    yield c
    c.stop()


def _quiet(cluster: Cluster) -> None:
    """Nothing runs or is counted in flight on the worker; its pool's invariants hold."""
    assert cluster.idle()
    deadline = time.monotonic() + 10
    while cluster.decode[0].drain_state.in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.decode[0].drain_state.in_flight() == []
    cluster.check_pools()


def _abort_after_first_token(cluster: Cluster, prompt: list[int], request_id: str) -> None:
    """A long request aborted through the router after its first token: its stream ends CANCELLED."""
    events = cluster.orchestrator.generate(prompt, LONG, request_id=request_id)
    next(events)
    assert cluster.orchestrator.abort(request_id)
    with pytest.raises(WorkerError) as info:
        list(events)
    assert info.value.code == grpc.StatusCode.CANCELLED


def test_concurrent_requests_share_one_session_and_equal_the_offline_engine(local, model_dir) -> None:
    prompts = random_prompts([3, 9, 17, 31, 40, 5], vocab=300, seed=71)
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(local.generate, prompts))
    expected = [o.token_ids for o in LLM(model_dir, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                                 sampling_params=GREEDY)]
    assert got == expected
    session = local.orchestrator.workers.all()[0]._session
    assert session is not None and not session._streams  # the requests went over it and are done
    _quiet(local)


def test_an_aborted_request_stops_on_the_worker(local) -> None:
    _abort_after_first_token(local, [5, 6, 7], "long")
    _quiet(local)
    assert len(local.generate([5, 6, 7])) == GREEDY.max_tokens  # the session serves on


def test_refusals_keep_their_status(local) -> None:
    with pytest.raises(WorkerError) as info:
        local.generate(list(range(10, 10 + 300)))  # past max_model_len (256)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in str(info.value)
    _quiet(local)
    assert len(local.generate([8, 9])) == GREEDY.max_tokens


def test_a_session_cut_by_the_router_aborts_its_requests_and_the_next_request_opens_another(local) -> None:
    events = local.orchestrator.generate([11, 12, 13], LONG)
    next(events)  # running over the session
    handle = local.orchestrator.workers.all()[0]
    first = handle._session._call
    local.orchestrator.loop.run(handle._session.close())
    with pytest.raises(WorkerError) as info:
        list(events)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE  # after its first token: not retried elsewhere
    _quiet(local)  # the worker aborted what the cut session ran
    assert len(local.generate([14, 15])) == GREEDY.max_tokens
    assert handle._session._call is not first


def _hold_after(worker: DecodeWorker, steps: int) -> None:
    """Let the worker's engine take `steps` steps, then no more (its loop still runs posted calls between the
    empty steps, aborts included): a request on it can neither finish nor run ahead of a deadline or a stall,
    however fast or loaded the machine is."""
    step = worker.engine.step
    taken = 0

    def held(**kw) -> list:  # type: ignore[no-untyped-def]
        nonlocal taken
        # held, unless nothing is left to run: then a step only applies the async step still in flight
        if taken >= steps and worker.engine.scheduler.has_unfinished():
            time.sleep(0.005)  # a stopped engine: an empty step, not a busy loop
            return []
        taken += 1
        return step(**kw)

    worker.engine.step = held  # type: ignore[method-assign]


def test_a_stalled_client_and_a_deadline_are_aborted_over_the_session(model_dir) -> None:
    # the request (10,000 tokens, capped at max_model_len 256) would finish in about a second on a fast machine,
    # so the worker stops after 32 steps: only the stall or the deadline can end it, and only the router's abort
    # over the session can free it on the worker
    for resilience, code in ((ResilienceConfig(stream_buffer_events=2, stream_stall_timeout_s=0.3),
                              grpc.StatusCode.RESOURCE_EXHAUSTED),
                             (ResilienceConfig(stream_timeout_s=1.0), grpc.StatusCode.DEADLINE_EXCEEDED)):
        cluster = Cluster(model_dir, num_prefill=0, num_decode=1, router=False,
                          config=OrchestratorConfig(resilience=resilience))
        cluster.wait_ready()
        _hold_after(cluster.decode[0], 32)
        try:
            events = cluster.orchestrator.generate([20, 21, 22], LONG)
            with pytest.raises(WorkerError) as info:
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    next(events)
                    # not reading: up to 31 more events wait in the router, past the buffer's 2 for longer than the
                    # stall timeout; the router aborts the request, and the worker drops it
                    assert cluster.idle(timeout=30), "the stalled request was not aborted on the worker"
                list(events)  # the deadline (1 s) ends the held request
            assert info.value.code == code, info.value
            _quiet(cluster)
        finally:
            cluster.stop()


def _drive(stub, first: list[worker_pb2.SessionRequest], then: list[worker_pb2.SessionRequest], finished: set[str],
           num_refused: int, timeout: float = 60):
    """Drive a worker's Session directly: send `first`, then `then` once a token came back; read until every id
    in `finished` finished and `num_refused` refusals came. Returns (tokens by id, [(id, code, message)])."""
    started, done = threading.Event(), threading.Event()

    def requests():
        yield from first
        started.wait(timeout)
        yield from then
        done.wait(timeout)  # the session stays open until the reads are over

    tokens: dict[str, list[int]] = {}
    ended: set[str] = set()
    refused: list[tuple[str, grpc.StatusCode, str]] = []
    call = stub.Session(requests(), timeout=timeout)
    try:
        for batch in call:
            for r in batch.refused:
                refused.append((r.request_id, next(c for c in grpc.StatusCode if c.value[0] == r.code), r.message))
            for e in batch.events:
                assert e.finish_reason != "error", e.error
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
                started.set()
                if e.finish_reason:
                    ended.add(e.request_id)
            if finished <= ended and len(refused) >= num_refused:
                break
    finally:
        done.set()
        call.cancel()
    return tokens, refused


def test_the_worker_side_refuses_by_id_keeps_the_calls_tokens_and_cleans_up() -> None:
    model_dir, _ = nemotron_h("M*")
    worker = DecodeWorker(model_dir, EngineConfig(max_num_seqs=1, max_num_waiting=1, max_model_len=256),
                          metrics_port=None)
    step = worker.engine.step
    worker.engine.step = lambda **kw: (time.sleep(0.05), step(**kw))[1]  # type: ignore[method-assign]
    stub = worker_pb2_grpc.DecodeWorkerStub(insecure_channel(worker.start()))

    def generate(rid: str, prompt: list[int], params: SamplingParams) -> worker_pb2.SessionRequest:
        return worker_pb2.SessionRequest(generate=worker_pb2.GenerateLocalRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params)))

    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        # a runs (the one slot); then a prompt past max_model_len is refused, b waits (the one waiting place: a
        # holds the slot for 12 steps of >= 50 ms), full is refused, so is a duplicate of a running id
        then = [generate("big", list(range(300)), short), generate("b", [6, 7], short), generate("full", [9], short),
                generate("a", [1], short)]
        tokens, refused = _drive(stub, [generate("a", [5, 6, 7], short)], then, {"a", "b"}, 3)
        assert {(rid, code) for rid, code, _ in refused} == {
            ("full", grpc.StatusCode.RESOURCE_EXHAUSTED), ("a", grpc.StatusCode.ALREADY_EXISTS),
            ("big", grpc.StatusCode.INVALID_ARGUMENT)}
        assert "max_num_waiting" in next(m for rid, _, m in refused if rid == "full")
        for rid, prompt in (("a", [5, 6, 7]), ("b", [6, 7])):
            call = stub.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=rid + "-call", prompt_token_ids=prompt, sampling=sampling_to_proto(short)))
            assert tokens[rid] == [t for e in call for t in e.token_ids]  # the session's tokens are the call's
        # an abort on the session ends a long request; the session's end aborts what it still runs
        _drive(stub, [generate("x", [3, 4], LONG), generate("y", [3, 5], LONG)],
               [worker_pb2.SessionRequest(abort=common_pb2.AbortRequest(request_id="x"))], set(), 0)
        deadline = time.monotonic() + 10
        while (worker.loop.call(worker.engine.has_unfinished) or worker.drain_state.in_flight()) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not worker.loop.call(worker.engine.has_unfinished) and worker.drain_state.in_flight() == []
        worker.loop.call(worker.engine.pool.check)
    finally:
        worker.stop(grace=0)


def test_worker_sessions_off_sends_calls(model_dir) -> None:
    from hybridserve.cli import build_parser
    from hybridserve.cli_options import cluster_options

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--no-worker-sessions", "--no-ray"])
    config = cluster_options(args)["router"].orchestrator
    assert config.worker_sessions is False
    assert cluster_options(build_parser().parse_args(["serve", "--no-ray"]))["router"].orchestrator.worker_sessions
    cluster = Cluster(model_dir, num_prefill=0, num_decode=1, router=False, config=config)
    cluster.wait_ready()
    try:
        assert len(cluster.generate([30, 31])) == GREEDY.max_tokens
        assert cluster.orchestrator.workers.all()[0]._session is None  # a GenerateLocal call, no session made
    finally:
        cluster.stop()


def test_the_session_stream_forgives_a_slow_reader_and_stops_a_stalled_one() -> None:
    """The read-ahead bound of a session stream, on its own (no gRPC): a reader that catches up within the stall
    timeout gets every event; one that does not gets StreamStalled and the request's abort runs; a deadline
    ends a stream with DEADLINE_EXCEEDED."""
    from hybridserve.router.stream_buffer import StreamStalled
    from hybridserve.router.worker_session import SessionError, SessionStream, WorkerSession

    def events(stream: SessionStream, n: int) -> None:
        for i in range(n):
            stream._event(common_pb2.TokenEvent(request_id=stream.request_id, token_ids=[i]))

    async def run() -> None:
        session = WorkerSession("w", open_call=lambda: None)
        stalls: list[str] = []
        slow = SessionStream(session, "slow", 60).watch(2, 0.2, lambda: stalls.append("slow"))
        events(slow, 5)
        await asyncio.sleep(0.1)  # within the stall timeout
        assert [(await slow.get()).token_ids[0] for _ in range(5)] == [0, 1, 2, 3, 4]
        await asyncio.sleep(0.3)  # caught up: the stall timer is off
        assert not stalls and not slow.stalled
        stuck = SessionStream(session, "stuck", 60).watch(2, 0.2, lambda: stalls.append("stuck"))
        events(stuck, 5)
        await asyncio.sleep(0.4)
        assert stalls == ["stuck"] and stuck.stalled
        with pytest.raises(StreamStalled):
            await stuck.get()
        late = SessionStream(session, "late", 0.1)
        await asyncio.sleep(0.2)
        with pytest.raises(SessionError) as info:
            await late.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(run())


def test_disaggregated_token_streams_go_on_the_session_and_aborts_free_both_sides(model_dir) -> None:
    cluster = Cluster(model_dir, num_prefill=1, num_decode=1, router=False)
    cluster.wait_ready()
    try:
        prompts = random_prompts([20, 33, 47, 61], vocab=300, seed=72)
        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(cluster.generate, prompts))
        expected = [o.token_ids for o in LLM(model_dir, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                                     sampling_params=GREEDY)]
        assert got == expected
        assert not any(d.local for _, d in cluster.orchestrator.recent_decisions)  # prefilled on the prefill worker
        session = cluster.orchestrator.workers.snapshot()[1][0]._session
        assert session is not None and not session._streams
        _abort_after_first_token(cluster, random_prompts([40], vocab=300, seed=73)[0], "pd")
        _quiet(cluster)
        assert cluster.idle()
        # a ticket the worker does not know is refused on the session with the call's status
        stub = worker_pb2_grpc.DecodeWorkerStub(insecure_channel(cluster.decode[0].address))
        follow = worker_pb2.StreamTokensRequest(request_id="nope", ticket="no-such-ticket")
        _, refused = _drive(stub, [worker_pb2.SessionRequest(stream_tokens=follow)], [], set(), 1)
        assert [(rid, code) for rid, code, _ in refused] == [("nope", grpc.StatusCode.FAILED_PRECONDITION)]
        # a state committed before the session asks for its stream (the prefill won the race): every token comes
        prompt = random_prompts([25], vocab=300, seed=74)[0]
        ticket = stub.Reserve(worker_pb2.ReserveRequest(request_id="early", prompt_token_ids=prompt,
                                                        sampling=sampling_to_proto(GREEDY))).ticket
        prefill = worker_pb2_grpc.PrefillWorkerStub(insecure_channel(cluster.prefill[0].address))
        prefill.Prefill(worker_pb2.PrefillRequest(request_id="early", prompt_token_ids=prompt,
                                                  sampling=sampling_to_proto(GREEDY),
                                                  decode_address=cluster.decode[0].address, ticket=ticket), timeout=60)
        follow = worker_pb2.StreamTokensRequest(request_id="early", ticket=ticket)
        tokens, _ = _drive(stub, [worker_pb2.SessionRequest(stream_tokens=follow)], [], {"early"}, 0)
        assert tokens["early"] == LLM(model_dir, max_model_len=256).generate(
            prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
        _quiet(cluster)
    finally:
        cluster.stop()


@pytest.mark.parametrize("sessions", [True, False], ids=["session", "calls"])
def test_a_retired_worker_finishes_its_requests_then_its_session_closes(model_dir, sessions: bool) -> None:
    cluster = Cluster(model_dir, num_prefill=0, num_decode=2, router=False,
                      config=OrchestratorConfig(worker_sessions=sessions))
    try:
        cluster.wait_ready()
        events = cluster.orchestrator.generate([4, 5, 6], SamplingParams(max_tokens=40, temperature=0.0,
                                                                         ignore_eos=True))
        tokens = list(next(events).token_ids)
        busy = next(h for h in cluster.orchestrator.workers.all() if h._aio_channel is not None)  # the one used
        stays = next(w.address for w in cluster.decode if w.address != busy.address)
        cluster.orchestrator.update_workers([], [stays])  # `busy` leaves the set with a request in flight
        assert [h.address for h in cluster.orchestrator.workers.all()] == [stays]
        tokens += [t for event in events for t in event.token_ids]
        assert len(tokens) == 40  # finished on the retired worker, not cut
        deadline = time.monotonic() + 10
        while (busy._session is not None or busy._aio_channel is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert busy._session is None and busy._aio_channel is None  # then its session and channel closed
        assert not cluster.orchestrator._retiring
        assert cluster.idle()
        assert len(cluster.generate([4, 5, 6])) == GREEDY.max_tokens  # the remaining worker serves
    finally:
        cluster.stop()


def test_closing_the_router_does_not_wait_for_a_retired_workers_request(model_dir) -> None:
    cluster = Cluster(model_dir, num_prefill=0, num_decode=2, router=False)
    try:
        cluster.wait_ready()
        events = cluster.orchestrator.generate([7, 8], LONG)
        next(events)
        busy = next(h for h in cluster.orchestrator.workers.all() if h._session is not None and h._session._streams)
        cluster.orchestrator.update_workers([], [w.address for w in cluster.decode if w.address != busy.address])
        assert cluster.orchestrator._retiring  # waiting for the long request
        start = time.monotonic()
        cluster.orchestrator.close()
        assert time.monotonic() - start < 8 and busy._session is None  # the request was cut, not waited for
    finally:
        for w in cluster.decode:
            w.stop(grace=0)
