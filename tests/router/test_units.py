"""Router pieces without workers: prefix index, policy, breaker, admission, text stream, chat template."""

from __future__ import annotations

import threading
import time

import pytest

from hybridserve.common.block_hash import block_hashes
from hybridserve.common.text_stream import TextStream
from hybridserve.proto import common_pb2, worker_pb2_grpc  # noqa: F401 - stubs are faked below
from hybridserve.router.admission import AdmissionController, Overloaded
from hybridserve.router.chat_template import ChatTemplate
from hybridserve.router.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from hybridserve.router.config import AdmissionConfig, OrchestratorConfig, ResilienceConfig, RoutingConfig
from hybridserve.router.metrics import RouterMetrics
from hybridserve.router.policy import RoutingPolicy, prompt_hashes
from hybridserve.router.prefix_index import PrefixIndex, WorkerHit
from hybridserve.router.workers import WorkerHandle

K = common_pb2.CacheEvent
BLOCK = 4


def _events(tokens: list[int], checkpoints_every: int, start_seq: int = 0) -> list[common_pb2.CacheEvent]:
    """STORED events of every block of `tokens`, with a checkpoint at each multiple of checkpoints_every."""
    hashes = [h.hex() for h in block_hashes(tokens, BLOCK)]
    out, seq = [], start_seq
    for i, h in enumerate(hashes):
        parent, end = hashes[i - 1] if i else "", (i + 1) * BLOCK
        out.append(K(sequence=seq, kind=K.BLOCK_STORED, block_hash=h, parent_hash=parent, num_tokens=end))
        seq += 1
        if end % checkpoints_every == 0:
            out.append(K(sequence=seq, kind=K.CHECKPOINT_STORED, block_hash=h, parent_hash=parent, num_tokens=end))
            seq += 1
    return out


def test_index_counts_only_checkpointed_contiguous_depth() -> None:
    index = PrefixIndex()
    tokens = list(range(10, 34))  # 6 blocks, checkpoints at 8, 16, 24
    index.apply("a", _events(tokens, 8))
    index.apply("b", _events(tokens[:12], 12))  # 3 blocks, a checkpoint at 12
    hits = index.match(prompt_hashes(tokens + [1], BLOCK))
    assert hits["a"] == WorkerHit(24, 24) and hits["b"] == WorkerHit(12, 12)
    other = tokens[:10] + [99] * 14  # diverges inside block 3
    hits = index.match(prompt_hashes(other, BLOCK))
    assert hits["a"] == WorkerHit(8, 8) and hits["b"] == WorkerHit(8, 0)  # KV without a checkpoint is no hit
    h24 = block_hashes(tokens, BLOCK)[5].hex()
    index.apply("a", [K(sequence=99, kind=K.CHECKPOINT_REMOVED, block_hash=h24, num_tokens=24)])
    assert index.match(prompt_hashes(tokens + [1], BLOCK))["a"] == WorkerHit(24, 16)
    index.replace("a", [])
    assert "a" not in index.match(prompt_hashes(tokens + [1], BLOCK))
    index.drop_worker("b")
    assert index.num_nodes() == 0


def test_prompt_hashes_leave_the_last_token_to_compute() -> None:
    assert len(prompt_hashes(list(range(8)), 4)) == 1  # the block ending on the last token can never hit
    assert len(prompt_hashes(list(range(9)), 4)) == 2
    assert prompt_hashes([1], 4) == [] and prompt_hashes(list(range(9)), None) == []


def _handle(role: str, address: str, running: int = 0, slots: int = 8, free: int = 8, queued: int = 0) -> WorkerHandle:
    health = common_pb2.HealthResponse(status="ok", role=role, num_running=running, total_state_slots=slots,
                                       free_state_slots=free, queued_prefill_tokens=queued, block_size=BLOCK)
    return WorkerHandle(role, address, stub=None, breaker=CircuitBreaker(3, 5.0), health=health)


def test_policy_follows_checkpoints_and_disaggregates_conditionally() -> None:
    index = PrefixIndex()
    policy = RoutingPolicy(RoutingConfig(local_prefill_max_tokens=4, local_prefill_min_hit_fraction=0.5), index)
    p0, p1 = _handle("prefill", "p0"), _handle("prefill", "p1")
    d0, d1 = _handle("decode", "d0"), _handle("decode", "d1")
    tokens = list(range(3, 35))
    index.apply("p1", _events(tokens[:16], 8))
    d = policy.decide(tokens, [p0, p1], [d0, d1], BLOCK)
    assert d.prefill is p1 and d.reason == "prefill_cached_prefix" and d.predicted_cached_tokens == 16
    index.apply("d1", _events(tokens[:24], 8))  # the previous turn lives on d1
    d = policy.decide(tokens, [p0, p1], [d0, d1], BLOCK)
    assert d.decode is d1 and d.local and d.reason == "decode_prefix_hit"
    d = policy.decide(tokens[:4], [p0, p1], [d0, d1], BLOCK)
    assert d.local and d.reason == "short_tail"
    d = policy.decide(tokens, [], [d0], BLOCK)
    assert d.local and d.reason == "no_prefill_worker"
    busy = _handle("prefill", "p1", running=4, queued=4096)
    d = policy.decide(list(range(100, 164)), [p0, busy], [d0], BLOCK)
    assert d.prefill is p0 and d.reason == "prefill_least_cost"
    full = _handle("decode", "d0", running=8, free=0)
    assert policy.decide(list(range(100, 164)), [p0], [full, d1], BLOCK, exclude={p0}).decode is d1


def test_circuit_breaker_opens_probes_and_closes() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=2, reset_s=1.0, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.state == CLOSED
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.available()
    now[0] = 1.5
    assert breaker.state == HALF_OPEN and breaker.acquire() and not breaker.acquire()  # one probe
    breaker.record_failure()
    assert breaker.state == OPEN
    now[0] = 3.0
    assert breaker.acquire()
    breaker.record_success()
    assert breaker.state == CLOSED


def test_a_half_open_worker_gets_exactly_one_probe_through_the_policy() -> None:
    now = [0.0]
    policy = RoutingPolicy(RoutingConfig(), PrefixIndex())
    flaky, steady = _handle("decode", "d0"), _handle("decode", "d1", running=6)  # flaky is the cheaper one
    flaky.breaker = CircuitBreaker(failures=1, reset_s=1.0, clock=lambda: now[0])
    flaky.breaker.record_failure()
    assert policy.decide(list(range(40)), [], [flaky, steady], BLOCK).decode is steady  # open: skipped
    now[0] = 2.0  # half-open: the first request probes it, the others go elsewhere until it answers
    chosen = [policy.decide(list(range(40)), [], [flaky, steady], BLOCK).decode for _ in range(5)]
    assert chosen == [flaky, steady, steady, steady, steady]
    flaky.breaker.record_success()
    assert policy.decide(list(range(40)), [], [flaky, steady], BLOCK).decode is flaky


def test_admission_refuses_when_full_and_times_out() -> None:
    admission = AdmissionController(AdmissionConfig(max_running=1, max_queued=1, queue_timeout_s=1.0))  # room on a loaded box
    admission.acquire()
    waiter_error = []
    waiter = threading.Thread(target=lambda: _catch(admission.acquire, waiter_error))
    waiter.start()
    while admission.queued == 0:
        pass
    with pytest.raises(Overloaded) as full:
        admission.acquire()
    assert full.value.queue_full
    waiter.join()
    assert waiter_error and not waiter_error[0].queue_full  # waited too long: 503
    admission.release()
    admission.acquire()
    admission.release()


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except Overloaded as exc:
        errors.append(exc)


class _Chars:
    """A tokenizer where token id = character code."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_and_cuts_at_stop_strings() -> None:
    stream = TextStream(_Chars(), stops=["END", "xyz"])
    assert stream.add([ord(c) for c in "abE"]) == "ab"  # "E" may start "END"
    assert stream.add([ord("N")]) == ""
    assert stream.add([ord("X")]) == "ENX"  # not a stop after all
    assert stream.add([ord(c) for c in "qENDmore"]) == "q" and stream.stopped
    assert stream.text == "abENXq" and stream.add([65]) == ""
    plain = TextStream(_Chars(), stops=["zz"])
    plain.add([ord("a"), ord("z")])
    assert plain.finish() == "z" and plain.text == "az"


def test_chat_template_fallback_and_tokenizer_config(tmp_path) -> None:
    fallback = ChatTemplate.from_model_dir(tmp_path)
    assert fallback.is_fallback
    text = fallback.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}'
        '{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}')
    own = ChatTemplate.from_model_dir(tmp_path)
    assert not own.is_fallback and own.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"


def test_configs_validate() -> None:
    with pytest.raises(ValueError):
        RoutingConfig(local_prefill_min_hit_fraction=1.5)
    with pytest.raises(ValueError):
        ResilienceConfig(attempts=0)
    with pytest.raises(ValueError):
        AdmissionConfig(max_running=0)
    assert OrchestratorConfig(local_prefill_max_tokens=7).routing.local_prefill_max_tokens == 7


class _FakeCall:
    """A server stream: iterates its batches, then blocks until cancelled."""

    def __init__(self, batches: list[common_pb2.CacheEventBatch]) -> None:
        self._batches = batches
        self._cancelled = threading.Event()

    def __iter__(self):
        for batch in self._batches:
            if self._cancelled.is_set():
                return
            yield batch
        self._cancelled.wait(5)

    def cancel(self) -> None:
        self._cancelled.set()


class _FakeFeed:
    """A worker whose first subscription loses events (a sequence jump); the second one is clean."""

    def __init__(self, tokens: list[int]) -> None:
        events = _events(tokens, 8)
        self.requests: list[common_pb2.CacheEventsRequest] = []
        self.subscriptions = [
            [common_pb2.CacheEventBatch(snapshot=True, next_sequence=0),
             common_pb2.CacheEventBatch(events=events[:2], next_sequence=2),
             common_pb2.CacheEventBatch(events=events[5:], next_sequence=len(events))],  # 2..4 lost
            [common_pb2.CacheEventBatch(snapshot=True, events=events, next_sequence=len(events))],
        ]

    def CacheEvents(self, request):  # noqa: N802 - the stub's method name
        self.requests.append(request)
        return _FakeCall(self.subscriptions[min(len(self.requests), 2) - 1])


def test_subscriber_resyncs_from_a_snapshot_after_lost_events() -> None:
    from hybridserve.router.cache_subscriber import CacheSubscriber

    tokens = list(range(10, 34))
    index, resyncs = PrefixIndex(), []
    feed = _FakeFeed(tokens)
    subscriber = CacheSubscriber("w", feed, index, on_resync=resyncs.append)
    try:
        deadline = time.monotonic() + 5
        while subscriber.num_snapshots < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert resyncs == ["gap"] and all(r.snapshot for r in feed.requests)
        assert index.match(prompt_hashes(tokens + [1], BLOCK))["w"] == WorkerHit(24, 24)
    finally:
        subscriber.stop()


def test_gauges_are_read_at_scrape_time_and_labelled_children_are_reused() -> None:
    metrics = RouterMetrics()
    admission = AdmissionController(AdmissionConfig(max_running=2, max_queued=1), metrics)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"hybridserve_router_{name}")

    assert sample("running_requests") == 0 and sample("queued_requests") == 0
    assert admission.try_acquire("a") and admission.try_acquire("b")
    assert sample("running_requests") == 2
    admission.release("a")
    assert sample("running_requests") == 1
    assert sample("prefix_index_hit_ratio") == 0  # nothing routed yet
    metrics.observe_hit(100, 25)
    metrics.observe_hit(100, 0)
    assert sample("prefix_index_hit_ratio") == 0.125
    assert metrics.child(metrics.requests, "grpc/Generate", "200") is metrics.requests.labels("grpc/Generate", "200")
    metrics.count_request("grpc/Generate", "200")
    metrics.count_error("overloaded")
    assert metrics.registry.get_sample_value("hybridserve_router_requests_total",
                                             {"endpoint": "grpc/Generate", "status": "200"}) == 1
    assert metrics.registry.get_sample_value("hybridserve_router_errors_total", {"kind": "overloaded"}) == 1
