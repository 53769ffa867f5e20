"""Disaggregated prefill -> decode over gRPC gives the in-process tokens; transfer faults fail cleanly.

Workers run in this process (threads, real gRPC on loopback) unless a test says otherwise.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest
import torch
from checkpoints import mamba2, nemotron_h, random_prompts
from router_cluster import Cluster as RouterCluster

from hybridserve import LLM, SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.orchestrator import Orchestrator, WorkerError
from hybridserve.transfer.grpc_sender import encode_state
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.planes import TransferConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(prefill_chunk_size=16, max_num_seqs=8)


TRANSFER = TransferConfig(grpc_chunk_bytes=512)


def Cluster(model_dir, num_prefill: int = 1, num_decode: int = 1) -> RouterCluster:  # noqa: N802 - a factory
    """The shared test cluster, orchestrator only, with small chunks so that states span many of them."""
    return RouterCluster(model_dir, num_prefill, num_decode, engine=CONFIG, transfer=TRANSFER, router=False)


@pytest.fixture(scope="module")
def nemotron_cluster():
    model_dir, _ = nemotron_h("M*-M*")
    cluster = Cluster(model_dir, num_prefill=2, num_decode=2)
    yield model_dir, cluster
    cluster.stop()


def _reference(model_dir, prompts, params=GREEDY):
    return [o.token_ids for o in LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=params)]


def test_disaggregated_equals_in_process_concurrently(nemotron_cluster) -> None:
    model_dir, cluster = nemotron_cluster
    prompts = random_prompts([1, 7, 16, 33, 50], vocab=128, seed=40)
    with futures.ThreadPoolExecutor(max_workers=5) as pool:
        got = list(pool.map(cluster.generate, prompts))
    assert got == _reference(model_dir, prompts)
    # the same prompts again: the prefill side now hits its prefix cache
    again = [cluster.generate(p) for p in prompts]
    assert again == got
    cluster.check_pools()


def test_seeded_sampling_survives_the_handoff(nemotron_cluster) -> None:
    model_dir, cluster = nemotron_cluster
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=99, ignore_eos=True)
    prompt = random_prompts([12], vocab=128, seed=41)[0]
    # the first token is sampled by the prefill worker, the rest by the decode worker, one generator each;
    # the in-process run must match only in the first token and in being repeatable
    first = cluster.generate(prompt, params)
    assert cluster.generate(prompt, params) == first and len(first) == 6


def test_mamba2_disaggregated_equals_in_process() -> None:
    model_dir, _ = mamba2()
    cluster = Cluster(model_dir)
    try:
        prompts = random_prompts([3, 20], vocab=128, seed=42)
        assert [cluster.generate(p) for p in prompts] == _reference(model_dir, prompts)
        cluster.check_pools()
    finally:
        cluster.stop()


def _reserve(cluster: Cluster, prompt: list[int]) -> tuple[worker_pb2_grpc.DecodeWorkerStub, str, str]:
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode[0].address))
    request_id = uuid.uuid4().hex
    ticket = stub.Reserve(
        worker_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY))
    ).ticket
    return stub, request_id, ticket


def _state_messages(cluster: Cluster, prompt: list[int], request_id: str, ticket: str) -> list[worker_pb2.StateChunk]:
    """A genuine state stream produced by the prefill worker's engine."""
    worker = cluster.prefill[0]
    rid = f"src-{request_id}"
    outs = list(worker.loop.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), rid, hold_state=True))
    exported = worker.loop.call(lambda: worker.engine.export_state(rid))
    header = StateHeader(ticket, request_id, worker.fingerprint, len(prompt), outs[-1].token_ids[0], 0)
    return list(encode_state(header, exported.specs, exported.parts, chunk_bytes=256))


def _push_fails(stub, messages, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.PushState(iter(messages), timeout=30)
    assert info.value.code() == code, info.value.details()


def _stream_reports_error(stub, request_id: str, ticket: str) -> None:
    events = list(stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30))
    assert events and events[-1].finish_reason == "error"


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "other-model", "drop-chunk"])
def test_transfer_faults_fail_cleanly_and_leave_no_state(nemotron_cluster, fault: str) -> None:
    model_dir, cluster = nemotron_cluster
    prompt = random_prompts([40], vocab=128, seed=43)[0]
    stub, request_id, ticket = _reserve(cluster, prompt)
    tokens = stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30)
    messages = _state_messages(cluster, prompt, request_id, ticket)
    if fault == "corrupt":
        payload = bytearray(messages[2].data.payload)
        payload[0] ^= 0x01
        messages[2].data.payload = bytes(payload)
        _push_fails(stub, messages, grpc.StatusCode.DATA_LOSS)
    elif fault == "truncate":
        _push_fails(stub, messages[:-4], grpc.StatusCode.DATA_LOSS)
    elif fault == "other-model":
        messages[0].manifest.model_fingerprint = "0" * 32
        _push_fails(stub, messages, grpc.StatusCode.FAILED_PRECONDITION)
    else:
        _push_fails(stub, messages[:2] + messages[3:], grpc.StatusCode.DATA_LOSS)
    events = list(tokens)
    assert events[-1].finish_reason == "error"
    assert cluster.idle()
    cluster.check_pools()
    # nothing stale: the next request is exact
    assert cluster.generate(prompt) == _reference(model_dir, [prompt])[0]


def test_sender_dying_mid_stream_frees_the_reservation(nemotron_cluster) -> None:
    model_dir, cluster = nemotron_cluster
    prompt = random_prompts([30], vocab=128, seed=44)[0]
    stub, request_id, ticket = _reserve(cluster, prompt)
    tokens = stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30)
    messages = _state_messages(cluster, prompt, request_id, ticket)

    decode = cluster.decode[0]
    opened = threading.Event()

    def dying_sender():
        yield from messages[:3]
        # dies mid-stream, after the worker has read the manifest: a cancel that beats the manifest names no
        # ticket, and that reservation is the router's to abort (or its ttl's to reap)
        deadline = time.monotonic() + 10
        while decode.take(ticket).assembly is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if decode.take(ticket).assembly is not None:
            opened.set()
        raise ConnectionError("prefill worker died")

    with pytest.raises(grpc.RpcError):
        stub.PushState(dying_sender(), timeout=30)
    assert opened.is_set(), "the worker never opened the state: the sender died before its manifest was read"
    assert list(tokens)[-1].finish_reason == "error"
    assert cluster.idle()
    cluster.check_pools()


def test_a_state_that_lands_before_its_reader_streams_all_its_tokens(nemotron_cluster) -> None:
    """The prefill can finish before the router's StreamTokens arrives: the committed request runs and its
    reader, when it comes, gets every token (it used to find an "unknown or expired ticket")."""
    model_dir, cluster = nemotron_cluster
    prompt = random_prompts([30], vocab=128, seed=47)[0]
    stub, request_id, ticket = _reserve(cluster, prompt)
    assert stub.PushState(iter(_state_messages(cluster, prompt, request_id, ticket)), timeout=30).committed
    events = list(stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30))
    assert events[-1].finish_reason == "length"
    assert [t for e in events for t in e.token_ids] == _reference(model_dir, [prompt])[0]
    with pytest.raises(grpc.RpcError) as info:  # claimed once: a second reader is told it is gone
        list(stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.idle()
    cluster.check_pools()


def test_a_committed_state_no_reader_claims_expires(nemotron_cluster) -> None:
    _, cluster = nemotron_cluster
    decode = cluster.decode[0]
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address))
    request_id = uuid.uuid4().hex
    prompt = random_prompts([20], vocab=128, seed=48)[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ticket = stub.Reserve(worker_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=prompt,
                                                    sampling=sampling_to_proto(params), timeout_ms=500)).ticket
    assert stub.PushState(iter(_state_messages(cluster, prompt, request_id, ticket)), timeout=30).committed
    deadline = time.monotonic() + 30
    while decode._reservations and time.monotonic() < deadline:  # the reaper drops it half a second in
        time.sleep(0.05)
    assert not decode._reservations
    assert cluster.idle(timeout=30)  # aborted (or finished, unread): its room is free
    assert decode.loop.call(lambda: request_id not in decode.loop._streams)  # its unread stream was dropped
    assert request_id not in decode.drain_state.in_flight()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=30))
    assert "no reader claimed the token stream" in (info.value.details() or "")
    cluster.check_pools()


def test_decode_abort_mid_stream(nemotron_cluster) -> None:
    model_dir, cluster = nemotron_cluster
    prompt = random_prompts([30], vocab=128, seed=45)[0]
    stub, request_id, ticket = _reserve(cluster, prompt)
    messages = _state_messages(cluster, prompt, request_id, ticket)
    release = threading.Event()

    def slow_sender():
        yield from messages[:3]
        release.wait(30)
        yield from messages[3:]

    call = stub.PushState.future(slow_sender(), timeout=60)
    stub.Abort(common_pb2.AbortRequest(request_id=request_id))
    release.set()
    with pytest.raises(grpc.RpcError) as info:
        call.result()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.idle()
    cluster.check_pools()


def test_bad_requests_are_invalid_argument(nemotron_cluster) -> None:
    _, cluster = nemotron_cluster
    with pytest.raises(WorkerError) as info:
        list(cluster.orchestrator.generate([5, 999], GREEDY))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    cluster.check_pools()


def test_reservation_expires_and_frees_its_pages(nemotron_cluster) -> None:
    _, cluster = nemotron_cluster
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode[0].address))
    request_id = uuid.uuid4().hex
    prompt = random_prompts([20], vocab=128, seed=46)[0]
    ticket = stub.Reserve(
        worker_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY), timeout_ms=300
        )
    ).ticket
    free_before = cluster.decode[0].loop.call(lambda: cluster.decode[0].engine.stats()["free_state_slots"])
    _stream_reports_error(stub, request_id, ticket)
    free_after = cluster.decode[0].loop.call(lambda: cluster.decode[0].engine.stats()["free_state_slots"])
    assert free_after == free_before + 1
    cluster.check_pools()


def test_short_prompts_prefill_on_the_decode_worker() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    from hybridserve.router.orchestrator import OrchestratorConfig

    decode = DecodeWorker(model_dir, CONFIG)
    decode.start()
    # a prefill address that answers nothing: a local prefill must not touch it
    orchestrator = Orchestrator(["127.0.0.1:9"], [decode.address], OrchestratorConfig(local_prefill_max_tokens=16))
    try:
        prompts = random_prompts([5, 16], vocab=128, seed=47)
        got = [[t for e in orchestrator.generate(p, GREEDY) for t in e.token_ids] for p in prompts]
        assert got == _reference(model_dir, prompts)
        decode.loop.call(decode.engine.pool.check)
    finally:  # closed: its cache subscribers would go on reconnecting to ports later tests reuse
        orchestrator.close()
        decode.stop(grace=0)


def test_exported_parts_stay_valid_after_the_slot_is_reused() -> None:
    """Export hands out copies: the sender streams them while the engine reuses the released slot."""
    from hybridserve.engine.llm_engine import LLMEngine

    model_dir, _ = nemotron_h("M*-M*")
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
    first, second = random_prompts([20, 20], vocab=128, seed=48)
    engine.add_request(first, SamplingParams(max_tokens=1, temperature=0.0), "a", hold_state=True)
    while engine.has_unfinished():
        engine.step()
    exported = engine.export_state("a")
    snapshot = [p.clone() for p in exported.parts]
    engine.add_request(second, SamplingParams(max_tokens=3, temperature=0.0), "b")  # takes the same slot
    while engine.has_unfinished():
        engine.step()
    assert all(torch.equal(p, s) for p, s in zip(exported.parts, snapshot))


def test_a_held_state_is_exported_at_the_end_of_its_step() -> None:
    """`on_held` runs in the step the prompt finishes in: the state is exported there and the slot is free
    before the step returns (no extra trip to the loop); the export equals a later `export_state`."""
    from hybridserve.engine.llm_engine import LLMEngine

    model_dir, _ = nemotron_h("M*-M*")
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=2, prefill_chunk_size=8, enable_prefix_caching=False))
    prompt = random_prompts([20], vocab=128, seed=49)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    exports: dict[str, list[torch.Tensor]] = {}
    free_at_hook: list[int] = []

    def on_held(rid: str) -> None:
        exports[rid] = engine.export_state(rid).parts
        free_at_hook.append(engine.pool.slots.num_free)

    engine.add_request(prompt, params, "hooked", hold_state=True, on_held=on_held)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps == 3 and list(exports) == ["hooked"]  # 20 tokens in chunks of 8: exported in the last step
    assert free_at_hook == [engine.pool.slots.capacity]
    engine.add_request(prompt, params, "plain", hold_state=True)
    while engine.has_unfinished():
        engine.step()
    plain = engine.export_state("plain").parts
    assert all(torch.equal(a, b) for a, b in zip(exports["hooked"], plain))
    engine.add_request(prompt, params, "aborted", hold_state=True, on_held=on_held)
    engine.step()
    assert engine.abort("aborted")
    while engine.has_unfinished():
        engine.step()
    assert "aborted" not in exports
    engine.pool.check()


def test_prefill_with_the_arena_full_when_the_prompt_finishes_stages_after_it() -> None:
    """No arena room when the prompt finishes: the state stays held and is staged once room comes free, into
    an arena block (not loose copies); the next request takes the end-of-step export."""
    model_dir, _ = nemotron_h("M*-M*")
    cluster = Cluster(model_dir)
    try:
        prompts = random_prompts([30, 26], vocab=128, seed=50)
        sender = cluster.prefill[0].sender
        hog = sender.arena.allocate(sender.arena.capacity)
        threading.Timer(0.5, lambda: sender.arena.free(hog)).start()
        assert cluster.generate(prompts[0]) == _reference(model_dir, [prompts[0]])[0]
        assert sender.arena.free_bytes() == sender.arena.capacity
        assert cluster.generate(prompts[1]) == _reference(model_dir, [prompts[1]])[0]  # the hooked path
        assert sender.arena.free_bytes() == sender.arena.capacity
        cluster.check_pools()
    finally:
        cluster.stop()
