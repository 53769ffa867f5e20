"""A state streamed while its prompt prefills (gRPC plane, `grpc_early_send`): the KV of finished chunks
leaves before the first token exists; tokens equal the in-process engine's and the late path's; an abort
mid-prefill frees the arena block and the decode reservation; faults keep their statuses."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest
from checkpoints import nemotron_h, random_prompts
from router_cluster import Cluster

from hybridserve import LLM, SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.orchestrator import WorkerError
from hybridserve.transfer.early_state import EarlyState
from hybridserve.transfer.grpc_receiver import StateAssembly
from hybridserve.transfer.planes import TransferConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(prefill_chunk_size=16, max_num_seqs=4)
EARLY, LATE = TransferConfig(grpc_chunk_bytes=512, grpc_early_send=True), TransferConfig(grpc_chunk_bytes=512)


@pytest.fixture(scope="module")
def model_dir():
    return nemotron_h("M*-M*")[0]


@pytest.fixture(scope="module")
def early_cluster(model_dir):
    cluster = Cluster(model_dir, engine=CONFIG, transfer=EARLY, router=False)
    yield cluster
    cluster.stop()


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _count_early_sends(monkeypatch) -> list[int]:
    """Record the KV rows staged at each chunk boundary of early-sent states (EarlyState.advance)."""
    advances: list[int] = []
    advance = EarlyState.advance

    def counted(self, tokens, ready):
        advances.append(tokens)
        advance(self, tokens, ready)

    monkeypatch.setattr(EarlyState, "advance", counted)
    return advances


def _settled(cluster: Cluster) -> None:
    """Every arena block back, no reservation left, every pool consistent."""
    for p in cluster.prefill:
        _wait_for(lambda p=p: p.sender.arena.free_bytes() == p.sender.arena.capacity, "the prefill arena")
    for d in cluster.decode:
        _wait_for(lambda d=d: not d._reservations, "the decode reservations")
    cluster.check_pools()


def test_early_send_equals_in_process_and_the_late_path(model_dir, early_cluster, monkeypatch) -> None:
    advances = _count_early_sends(monkeypatch)
    prompts = random_prompts([70, 100, 45, 9], vocab=128, seed=60)  # several chunks of 16; the last one chunk
    reference = [o.token_ids for o in LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    with futures.ThreadPoolExecutor(max_workers=4) as pool:
        early = list(pool.map(lambda p: early_cluster.generate(p, GREEDY), prompts))
    assert advances, "no state went out early"
    assert early == reference
    late_cluster = Cluster(model_dir, engine=CONFIG, transfer=LATE, router=False)
    try:
        assert [late_cluster.generate(p, GREEDY) for p in prompts] == reference
        _settled(late_cluster)
    finally:
        late_cluster.stop()
    # again: the prefill side now starts from its cached prefix (the first chunk boundary lies past it)
    assert [early_cluster.generate(p, GREEDY) for p in prompts] == reference
    _settled(early_cluster)


class _Gate:
    """Pauses a worker's engine loop after its n-th step until released."""

    def __init__(self, worker, after_steps: int) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        step, count = worker.engine.step, [0]

        def gated(**kw):  # type: ignore[no-untyped-def]
            out = step(**kw)
            count[0] += 1
            if count[0] == after_steps:
                self.reached.set()
                self.release.wait(30)
            return out

        worker.engine.step = gated
        self._worker, self._step = worker, step

    def remove(self) -> None:
        self.release.set()
        self._worker.engine.step = self._step


def _reserve_and_prefill(cluster: Cluster, prompt: list[int]):
    """Reserve on the decode worker, open its token stream, then Prefill (in the background): (token events,
    prefill future)."""
    decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode[0].address))
    prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(cluster.prefill[0].address))
    request_id = uuid.uuid4().hex
    sampling = sampling_to_proto(GREEDY)
    ticket = decode.Reserve(worker_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=prompt,
                                                      sampling=sampling)).ticket
    tokens = decode.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket), timeout=60)
    call = prefill.Prefill.future(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        decode_address=cluster.decode[0].address, ticket=ticket), timeout=60)
    return request_id, tokens, call


def test_kv_of_finished_chunks_arrives_before_the_prompt_finishes(model_dir, early_cluster, monkeypatch) -> None:
    written: list[int] = []
    write = StateAssembly.write
    monkeypatch.setattr(StateAssembly, "write", lambda self, index, payload: (written.append(index),
                                                                               write(self, index, payload))[1])
    prompt = random_prompts([96], vocab=128, seed=61)[0]  # 6 chunks of 16
    gate = _Gate(early_cluster.prefill[0], after_steps=3)
    try:
        _, events, call = _reserve_and_prefill(early_cluster, prompt)
        assert gate.reached.wait(30)
        _wait_for(lambda: len(written) > 0, "KV chunks on the decode worker while the prefill is paused")
        assert not call.done()
    finally:
        gate.remove()
    assert call.result().bytes_sent > 0
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == LLM(model_dir).generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    _settled(early_cluster)


def test_abort_mid_prefill_frees_the_block_and_the_reservation(early_cluster) -> None:
    prompt = random_prompts([96], vocab=128, seed=62)[0]
    prefill, decode_worker = early_cluster.prefill[0], early_cluster.decode[0]
    gate = _Gate(prefill, after_steps=2)
    try:
        request_id, events, call = _reserve_and_prefill(early_cluster, prompt)
        assert gate.reached.wait(30)
        _wait_for(lambda: any(r.assembly is not None for r in decode_worker._reservations.values()),
                  "the early stream to open")
        assert prefill.sender.arena.free_bytes() < prefill.sender.arena.capacity  # the block is taken
        # the abort queues behind the paused step (as the prefill worker's Abort RPC does)
        aborter = threading.Thread(target=lambda: prefill.loop.fail(request_id, RuntimeError("aborted by test")))
        aborter.start()
    finally:
        gate.remove()
    aborter.join(30)
    with pytest.raises(grpc.RpcError):
        call.result()
    # nobody told the decode worker: the cancelled stream alone frees its reservation and ends its tokens
    assert list(events)[-1].finish_reason == "error"
    _settled(early_cluster)
    assert early_cluster.generate(prompt, GREEDY)  # nothing stale


def test_an_early_stream_for_another_model_fails_cleanly(early_cluster, monkeypatch) -> None:
    prefill = early_cluster.prefill[0]
    monkeypatch.setattr(prefill, "fingerprint", "0" * 32)
    prompt = random_prompts([64], vocab=128, seed=63)[0]
    with pytest.raises(WorkerError) as info:
        early_cluster.generate(prompt, GREEDY)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    _settled(early_cluster)


def test_no_arena_room_at_the_first_chunk_boundary_sends_the_usual_way(model_dir, early_cluster, monkeypatch) -> None:
    advances = _count_early_sends(monkeypatch)
    sender = early_cluster.prefill[0].sender
    hog = sender.arena.allocate(sender.arena.capacity)
    threading.Timer(0.3, lambda: sender.arena.free(hog)).start()
    prompt = random_prompts([80], vocab=128, seed=64)[0]
    got = early_cluster.generate(prompt, GREEDY)
    assert got == LLM(model_dir).generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    assert not advances
    _settled(early_cluster)


# ---- the last chunk's forward: KV rest and Mamba states staged layer by layer ----------------------------
@pytest.fixture(scope="module")
def layered_dir():
    return nemotron_h("M*MM-")[0]  # the last attention layer comes early; two Mamba layers and an MLP follow it


def _record_forward_and_staging(worker, monkeypatch) -> list[tuple]:
    """("layer", i) as each layer of the prefill worker's model starts, ("frontier", bytes) whenever the bytes
    handed to the sender's producer grow (EarlyState._range_staged), ("layer_staged", pool index, state id)."""
    from hybridserve.transfer.layer_staging import LayerStager

    log: list[tuple] = []
    for index, layer in enumerate(worker.engine.model.layers):
        monkeypatch.setattr(layer.mixer, "forward", _logged(layer.mixer.forward, log, ("layer", index)))
    grow, staged_layer = EarlyState._range_staged, EarlyState.layer_staged

    def logged_grow(self, start, end, ready):
        grow(self, start, end, ready)
        log.append(("frontier", self._frontier, self.total_bytes))

    def logged_layer(self, layer, ready):
        log.append(("layer_staged", layer, id(self)))
        staged_layer(self, layer, ready)

    monkeypatch.setattr(EarlyState, "_range_staged", logged_grow)
    monkeypatch.setattr(EarlyState, "layer_staged", logged_layer)
    assert LayerStager  # imported: the worker builds one per early request
    return log


def _logged(forward, log: list[tuple], entry: tuple):
    def run(*args, **kwargs):
        log.append(entry)
        return forward(*args, **kwargs)

    return run


@pytest.fixture(scope="module")
def layered_cluster(layered_dir):
    cluster = Cluster(layered_dir, engine=CONFIG, transfer=EARLY, router=False)
    yield cluster
    cluster.stop()


def test_mamba_states_go_to_the_sender_before_the_later_layers_run(layered_dir, layered_cluster, monkeypatch) -> None:
    prefill = layered_cluster.prefill[0]
    log = _record_forward_and_staging(prefill, monkeypatch)
    prompt = random_prompts([70], vocab=128, seed=65)[0]  # 5 chunks of 16: the last one computes 6 tokens
    got = layered_cluster.generate(prompt, GREEDY)
    assert got == LLM(layered_dir).generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
    last_forward = log[max(i for i, e in enumerate(log) if e == ("layer", 0)):]
    assert [e[1] for e in last_forward if e[0] == "layer_staged"] == [0, 1, 2]  # every Mamba layer, in order

    def frontier_before(layer: int) -> int:
        before = last_forward[: last_forward.index(("layer", layer))]
        return max((e[1] for e in before if e[0] == "frontier"), default=0)

    cache = prefill.engine.cache
    specs = prefill.engine.state_specs(len(prompt))  # the plain layout; the early one splits the KV
    row_bytes = specs[0].nbytes // len(prompt)
    kv_head = (len(prompt) - CONFIG.prefill_chunk_size) * row_bytes  # rows final before the last chunk for sure
    ssm_layer = cache.ssm_states[0, 0].numel() * cache.ssm_states.element_size()
    total, hidden = sum(s.nbytes for s in specs), specs[-1].nbytes
    # layer 0's SSM state goes to the sender right after layer 0, before the attention layer 1 runs ...
    assert kv_head + ssm_layer <= frontier_before(1) < kv_head + 2 * ssm_layer  # ... and not layer 2's yet
    # every Mamba state, conv window and the KV tail are with the sender before the MLP layer 4 runs
    assert frontier_before(4) == total - hidden
    _settled(layered_cluster)


def test_multi_chunk_prompts_with_the_layer_path_equal_in_process(layered_dir, layered_cluster, monkeypatch) -> None:
    log = _record_forward_and_staging(layered_cluster.prefill[0], monkeypatch)
    # several chunks of 16 (how many tokens each step gives each prompt depends on the others); 12: one step, no
    # early send; a last chunk of one token is a decode row, which runs no layer hook (staged at the step's end)
    prompts = random_prompts([40, 33, 70, 90, 12], vocab=128, seed=66)
    reference = [o.token_ids for o in LLM(layered_dir).generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    with futures.ThreadPoolExecutor(max_workers=5) as pool:
        got = list(pool.map(lambda p: layered_cluster.generate(p, GREEDY), prompts))
    assert got == reference
    layers: dict[int, list[int]] = {}
    for entry in log:
        if entry[0] == "layer_staged":
            layers.setdefault(entry[2], []).append(entry[1])
    assert len(layers) >= 2 and all(staged == [0, 1, 2] for staged in layers.values())
    _settled(layered_cluster)


def test_a_fault_mid_way_through_the_last_forward_frees_everything(layered_cluster, monkeypatch) -> None:
    from hybridserve.transfer.layer_staging import LayerStager

    handed: list[int] = []
    call = LayerStager.__call__

    def failing(self, request, layer):
        call(self, request, layer)
        handed.append(self.early._frontier)
        if layer == 2:  # after the KV rest and two Mamba states went to the sender
            raise RuntimeError("injected fault in the last chunk's forward")

    monkeypatch.setattr(LayerStager, "__call__", failing)
    prompt = random_prompts([70], vocab=128, seed=67)[0]
    with pytest.raises(WorkerError):
        layered_cluster.generate(prompt, GREEDY)
    assert max(handed) > 0
    _settled(layered_cluster)
    monkeypatch.undo()
    assert layered_cluster.generate(prompt, GREEDY)  # nothing stale


def test_a_split_kv_layout_is_accepted_and_lands_like_the_plain_one(layered_cluster) -> None:
    import torch

    from hybridserve.transfer.manifest import StateHeader, TransferError, build_manifest, check_manifest
    from hybridserve.transfer.state_layout import split_kv_specs, write_request_state

    engine = layered_cluster.decode[0].engine
    plain = engine.state_specs(40)
    split = split_kv_specs(plain, 29)
    assert [s.name for s in split] == ["kv", "ssm", "conv", "kv_tail", "hidden"]
    assert [s.shape[0] for s in split if s.name.startswith("kv")] == [29, 11]
    assert sum(s.nbytes for s in split) == sum(s.nbytes for s in plain)
    header = StateHeader("t", "r", "fp", 40, 0, 0)
    assert check_manifest(build_manifest(header, split, 512), "t", "fp", 40, plain) == split
    assert check_manifest(build_manifest(header, plain, 512), "t", "fp", 40, plain) == plain
    wrong = [*split[:3], dataclasses.replace(split[3], shape=(12, *split[3].shape[1:])), split[4]]
    with pytest.raises(TransferError, match="do not match"):
        check_manifest(build_manifest(dataclasses.replace(header, num_tokens=40), wrong, 512), "t", "fp", 40, plain)
    with pytest.raises(ValueError, match="cannot split"):
        split_kv_specs(plain, 40)
    # the two KV tensors land in the pages exactly as the one plain tensor does (on copies of the idle worker's pools)
    cache = copy.copy(engine.cache)
    cache.k_pages, cache.v_pages = torch.zeros_like(cache.k_pages), torch.zeros_like(cache.v_pages)
    kv, pages = torch.randn(plain[0].shape), list(range(-(-40 // engine.config.page_size)))
    write_request_state(cache, pages, None, 40, {"kv": kv})
    plain_k, plain_v = cache.k_pages.clone(), cache.v_pages.clone()
    cache.k_pages.zero_(), cache.v_pages.zero_()
    write_request_state(cache, pages, None, 40, {"kv": kv[:29], "kv_tail": kv[29:]})
    assert torch.equal(cache.k_pages, plain_k) and torch.equal(cache.v_pages, plain_v) and plain_k.abs().sum() > 0
