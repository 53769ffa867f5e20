"""Client-side orchestration of one request across the workers: route, reserve, prefill, stream.

The policy (`router/policy.py`) picks a decode worker and either a prefill worker (reserve on decode ->
prefill into that reservation -> stream tokens) or none (the decode worker prefills locally). Until the first
token arrives, a worker that answers UNAVAILABLE is excluded and the request is retried elsewhere after a
jittered exponential backoff; after it, failures surface as errors (tokens already went out). Every call has
a deadline; every exit that is not a finished stream aborts the request on both workers. Request ids are
idempotent: a second request with the id of one still in flight is refused (ALREADY_EXISTS) instead of
running twice, and `abort(request_id)` cancels it wherever it is.

It is asyncio code on grpc.aio channels, running on the router's one event loop (`router/event_loop.py`)
together with both front doors: `stream()` is awaited there; `generate()` is the same stream for callers on
other threads (tests, tools). The token stream is read ahead into a bounded buffer (`router/stream_buffer.py`):
a client that stops reading gets its request aborted instead of growing the router's memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any

import grpc

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.router.active_request import ActiveRequest as _Active
from hybridserve.router.active_request import aborted as _aborted
from hybridserve.router.config import OrchestratorConfig
from hybridserve.router.event_loop import LoopThread
from hybridserve.router.metrics import RouterMetrics
from hybridserve.router.policy import Decision, NoWorkerError, RoutingPolicy
from hybridserve.router.prefix_index import PrefixIndex
from hybridserve.router.request_errors import RetryElsewhere as _Retry
from hybridserve.router.request_errors import WorkerBusy as _Busy
from hybridserve.router.request_errors import WorkerError
from hybridserve.router.stream_buffer import StreamBuffer, StreamStalled
from hybridserve.router.worker_aborts import WorkerAborts
from hybridserve.router.worker_session import SessionStream
from hybridserve.router.workers import WorkerHandle, WorkerSet

__all__ = ["Orchestrator", "OrchestratorConfig", "WorkerError"]

logger = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_BREAKER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Orchestrator:
    """Routes requests over a changing set of prefill and decode workers, on `loop` (its own when None)."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str],
                 config: OrchestratorConfig = OrchestratorConfig(), metrics: RouterMetrics | None = None,
                 subscribe_cache_events: bool = True, internal_token: str | None = None,
                 internal_tls: InternalTlsConfig | None = None, loop: LoopThread | None = None) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.loop = loop or LoopThread()
        self.index = PrefixIndex()
        self.workers = WorkerSet(self.index, config.resilience, subscribe_cache_events,
                                 on_resync=lambda reason: self.metrics.index_resyncs.inc(), internal_token=internal_token,
                                 internal_tls=internal_tls)
        self.policy = RoutingPolicy(config.routing, self.index)
        self._active: dict[str, _Active] = {}  # touched on the loop only (reads elsewhere are atomic dict reads)
        self._aborts = WorkerAborts(self.config.resilience.control_timeout_s)  # fire-and-forget, still running
        self._retiring: dict[concurrent.futures.Future, WorkerHandle] = {}  # left the set, closing on the loop
        self.recent_decisions: deque[tuple[str, Decision]] = deque(maxlen=1024)  # (request id, decision)
        # clients repeat their sampling settings: convert each distinct one once (the message is only ever copied
        # into worker requests, never changed)
        self._sampling_proto = functools.lru_cache(maxsize=256)(sampling_to_proto)
        self.update_workers(prefill_addresses, decode_addresses)
        self.metrics.scrape_function(
            "seat_waiters", lambda: sum(len(w.seats) for w in self.workers.all() if w.role == "decode"))

    def update_workers(self, prefill_addresses: list[str], decode_addresses: list[str]) -> None:
        """Point at a new set of workers (after a restart moved one); in-flight requests keep their stubs."""
        if not decode_addresses:
            raise ValueError("at least one decode worker address is needed")
        for gone in self.workers.update(list(prefill_addresses), list(decode_addresses)):
            # its in-flight requests finish on it; then its session and channel close, on the loop
            future = asyncio.run_coroutine_threadsafe(
                gone.retire_aio(self.config.resilience.stream_timeout_s), self.loop.loop)
            self._retiring[future] = gone
            future.add_done_callback(self._retiring.pop)

    def close(self) -> None:
        """Abort what is in flight, close the channels, stop the loop (call from outside the loop)."""
        if self.loop.loop.is_running():
            try:
                self.loop.run(self._close(), timeout=10)
            except Exception:  # closing anyway
                logger.exception("closing the orchestrator's channels failed")
        self.workers.close()
        self.loop.stop()

    async def _close(self) -> None:
        for active in list(self._active.values()):
            active.cancel()
        await asyncio.sleep(0)  # let the cancelled streams unwind and start their worker aborts
        await self._aborts.wait(timeout_s=5)
        for retiring, handle in list(self._retiring.items()):
            retiring.cancel()
            await handle.close_aio()
        for handle in self.workers.all():
            await handle.close_aio()

    # ---- requests --------------------------------------------------------------------------------
    async def stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                     ) -> AsyncGenerator[common_pb2.TokenEvent, None]:
        """TokenEvents of one request, on the router's loop; raises WorkerError when it cannot be served."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._active:
            raise WorkerError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already in flight")
        active = self._active[request_id] = _Active(request_id)
        try:
            async for event in self._serve(list(prompt_token_ids), params, active):
                yield event
        finally:
            if self._active.get(request_id) is active:
                del self._active[request_id]

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                 ) -> Generator[common_pb2.TokenEvent, None, None]:
        """`stream()` for a caller on another thread: each event crosses to it from the loop."""
        events = self.stream(prompt_token_ids, params, request_id)

        async def step() -> common_pb2.TokenEvent | None:
            try:
                return await events.__anext__()
            except StopAsyncIteration:
                return None

        try:
            while (event := self.loop.run(step())) is not None:
                yield event
        finally:
            if self.loop.loop.is_running():
                self.loop.run(events.aclose())

    def abort(self, request_id: str) -> bool:
        """Cancel an in-flight request, from any thread (its workers are aborted as its stream unwinds)."""
        active = self._active.get(request_id)
        if active is None:
            return False
        self.loop.call_soon(active.cancel)
        return True

    def num_in_flight(self) -> int:
        return len(self._active)

    def abort_all(self) -> int:
        """Abort every request in flight (the end of a drain); returns how many."""
        active = list(self._active.values())
        for a in active:
            self.abort(a.request_id)
        return len(active)

    async def _serve(self, prompt: list[int], params: SamplingParams, active: _Active
                     ) -> AsyncGenerator[common_pb2.TokenEvent, None]:
        res = self.config.resilience
        start = time.perf_counter()
        sampling = self._sampling_proto(params)
        exclude: set[WorkerHandle] = set()
        last: _Retry | None = None
        attempt = 0
        busy_since: float | None = None
        head_of: WorkerHandle | None = None  # the request left this decode worker's seat queue from its head
        while attempt < res.attempts:
            if active.cancelled.is_set():
                raise WorkerError(grpc.StatusCode.CANCELLED, "the request was aborted")
            prefill, decode = self.workers.snapshot()
            try:
                decision = self.policy.decide(prompt, prefill, decode, self.workers.block_size(), exclude)
            except NoWorkerError as exc:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            if not decision.local and _needs_local(params):
                decision = Decision(decision.decode, None, "needs_local", 0)
            self.metrics.child(self.metrics.routing, "local" if decision.local else "disaggregated", decision.reason).inc()
            self.recent_decisions.append((active.request_id, decision))
            try:
                events, first = await self._start(decision, prompt, sampling, active)
            except _Busy as busy:
                # every slot or page of the chosen decode worker is taken: wait for one to free up (like a
                # local queue) instead of refusing, up to capacity_wait_s; not a fault, so no retry is spent
                busy_since = busy_since if busy_since is not None else time.perf_counter()
                if res.capacity_wait_s is not None and time.perf_counter() - busy_since > res.capacity_wait_s:
                    raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"decode workers stayed full for {res.capacity_wait_s:.0f} s: {busy}",
                                      f"decode workers stayed full for {res.capacity_wait_s:.0f} s") from None
                self.metrics.seat_waits.inc()
                at_head = await busy.worker.seats.wait(again=head_of is busy.worker, cancelled=active.cancelled)
                head_of = busy.worker if at_head else None
                continue
            except _Retry as retry:
                last = retry
                exclude.add(retry.worker)
                self.metrics.child(self.metrics.retries, retry.stage).inc()
                attempt += 1
                if attempt < res.attempts:
                    delay = random.uniform(0, min(res.backoff_cap_s, res.backoff_base_s * 2 ** (attempt - 1)))
                    logger.warning("request %s: %s; retrying in %.3f s", active.request_id, retry, delay)
                    await active.wait(delay)
                continue
            self.metrics.observe_hit(len(prompt), decision.predicted_cached_tokens)
            async for event in self._relay(decision, events, first, active, start):
                yield event
            return
        raise WorkerError(last.error.code() if last else grpc.StatusCode.UNAVAILABLE,
                          f"no worker could serve the request: {last}",
                          f"no worker could serve the request ({last.stage}: {last.error.code().name})" if last
                          else "no worker could serve the request")

    async def _start(self, d: Decision, prompt: list[int], sampling: common_pb2.SamplingOptions, active: _Active
                     ) -> tuple[Any, common_pb2.TokenEvent]:
        """Open the request on its workers and wait for the first event; raises _Retry or WorkerError."""
        res = self.config.resilience
        rid = active.request_id
        decode = d.decode.aio_stub()
        md = d.decode.metadata
        events = None
        active.session = None
        try:
            if d.local:
                request = worker_pb2.GenerateLocalRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
                events = await self._token_stream(d, active, worker_pb2.SessionRequest(generate=request),
                                                  lambda: decode.GenerateLocal(request, timeout=res.stream_timeout_s,
                                                                               metadata=md))
                return events, await self._first(d, events, d.decode, "generate_local", active)
            reserve = active.track(decode.Reserve(
                worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                          timeout_ms=int(res.reservation_ttl_s * 1000)),
                timeout=res.reserve_timeout_s, metadata=md))
            ticket = (await self._call(d.decode, "reserve", active, reserve)).ticket
            prefill = d.prefill
            if prefill is None:  # a non-local decision always names its prefill worker
                raise RuntimeError("routing chose remote prefill without a prefill worker")
            # the prefill starts first; the token stream is set up while it runs (the reservation queues what it
            # outputs until its reader comes)
            prefill_call = active.track(prefill.aio_stub().Prefill(
                worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                          decode_address=d.decode.address, ticket=ticket),
                timeout=res.prefill_timeout_s, metadata=prefill.metadata))
            follow = worker_pb2.StreamTokensRequest(request_id=rid, ticket=ticket)
            events = await self._token_stream(d, active, worker_pb2.SessionRequest(stream_tokens=follow),
                                              lambda: decode.StreamTokens(follow, timeout=res.stream_timeout_s,
                                                                          metadata=md))
            await self._call(prefill, "prefill", active, prefill_call)
            return events, await self._first(d, events, d.decode, "stream", active)
        except _Busy:  # the Reserve (or a local request) was refused: nothing exists on the workers to abort
            if events is not None:
                events.cancel()
            raise
        except _Retry:
            if events is not None:
                events.cancel()
            # awaited: a late Abort of this request id must not reach a worker after the retry's Reserve; in a
            # task of its own (shielded), so a client that goes away meanwhile does not cancel the abort
            await asyncio.shield(self._abort_task(d, active))
            raise
        except BaseException:
            if events is not None:
                events.cancel()
            self._abort_later(d, active)
            raise

    async def _token_stream(self, d: Decision, active: _Active, on_session: worker_pb2.SessionRequest,
                            call: Callable[[], Any]) -> Any:
        """The request's token stream from its decode worker: one message on the worker's session, or `call()`
        (sessions off, or a worker without them)."""
        session = d.decode.session(self.config.worker_socket_sessions) if self.config.worker_sessions else None
        if session is None:
            return active.track(call())
        active.session = session  # set first: an abort while the open is under way goes behind it
        return active.track(await session.open(on_session, self.config.resilience.stream_timeout_s))

    async def _call(self, worker: WorkerHandle, stage: str, active: _Active, call: Awaitable[Any]) -> Any:
        try:
            result = await call
        except grpc.RpcError as exc:
            self._fail(worker, exc, stage, active)
        except asyncio.CancelledError as exc:
            if _aborted(active):
                raise WorkerError(grpc.StatusCode.CANCELLED, "the request was aborted") from exc
            raise
        worker.breaker.record_success()
        return result

    async def _first(self, d: Decision, events: Any, worker: WorkerHandle, stage: str, active: _Active
                     ) -> common_pb2.TokenEvent:
        first = await self._call(worker, stage, active, events.read())
        if first is grpc.aio.EOF:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"{worker.address} closed the stream before any token",
                              f"the {worker.role} worker closed the stream before any token")
        return first

    def _fail(self, worker: WorkerHandle, exc: grpc.RpcError, stage: str, active: _Active) -> None:
        if exc.code() in _BREAKER_FAILURES:
            worker.breaker.record_failure()
        if active.cancelled.is_set() or exc.code() == grpc.StatusCode.CANCELLED:
            raise WorkerError(grpc.StatusCode.CANCELLED, "the request was aborted") from exc
        if exc.code() in _RETRYABLE:
            raise _Retry(worker, stage, exc) from exc
        # the decode worker has no seat (reserve) or its own queue is full (local): wait in line, do not refuse
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and stage in ("reserve", "generate_local"):
            raise _Busy(worker, stage, exc) from exc
        raise WorkerError(exc.code(), f"{stage} on {worker.role} worker {worker.address} failed: {exc.details()}",
                          exc.details()) from exc

    async def _relay(self, d: Decision, events: Any, first: common_pb2.TokenEvent, active: _Active, start: float
                     ) -> AsyncGenerator[common_pb2.TokenEvent, None]:
        """Yield the stream (first event included) until finished; abort both workers on any other exit."""
        res = self.config.resilience
        metrics = self.metrics
        finished = False
        tokens = 0  # counted once at the end: one counter update per request instead of one per event
        last = time.perf_counter()
        metrics.ttft.observe(last - start)
        on_stall = functools.partial(self._abort_later, d, active)
        buffer: StreamBuffer | SessionStream = (
            events.watch(res.stream_buffer_events, res.stream_stall_timeout_s, on_stall)
            if isinstance(events, SessionStream)
            else StreamBuffer(events, res.stream_buffer_events, res.stream_stall_timeout_s, on_stall))
        try:
            event = first
            while True:
                if event.finish_reason == "error":
                    raise WorkerError(grpc.StatusCode.INTERNAL, event.error or "decode failed")
                tokens += len(event.token_ids)
                if event.finish_reason:
                    # finished before the last yield: a reader that stops at the last event (closing this
                    # generator there) has read a finished stream, which needs no abort
                    finished = True
                    metrics.worker_cached.inc(event.num_cached_tokens)
                    metrics.e2e.observe(time.perf_counter() - start)
                    yield event
                    return
                yield event
                following = await buffer.get()
                if following is None:
                    raise WorkerError(grpc.StatusCode.UNAVAILABLE, "the decode worker closed the stream early")
                event = following
                now = time.perf_counter()
                metrics.inter_token.observe(now - last)
                last = now
        except StreamStalled as exc:
            raise WorkerError(exc.code, str(exc)) from exc
        except grpc.RpcError as exc:
            if active.cancelled.is_set() or exc.code() == grpc.StatusCode.CANCELLED:
                raise WorkerError(grpc.StatusCode.CANCELLED, "the request was aborted") from exc
            raise WorkerError(exc.code(), f"decode stream failed: {exc.details()}") from exc
        except asyncio.CancelledError as exc:
            if _aborted(active):
                raise WorkerError(grpc.StatusCode.CANCELLED, "the request was aborted") from exc
            raise
        finally:
            metrics.generation_tokens.inc(tokens)
            buffer.close()
            if not finished and not buffer.stalled:  # client went away or failure: free everything on both sides
                events.cancel()
                self._abort_later(d, active)  # frees the seat once the abort is through
            elif finished:
                d.decode.seats.seat_freed()

    def _abort_later(self, d: Decision, active: _Active) -> None:
        """Abort the request on its workers in a task of its own: it runs even when the request's task is being
        cancelled, and the caller's error goes out without waiting for it."""
        self._aborts.start(d, active.request_id, active.session)

    def _abort_task(self, d: Decision, active: _Active) -> asyncio.Task:
        return self._aborts.start(d, active.request_id, active.session)


def _needs_local(params: SamplingParams) -> bool:
    """Logprobs are computed where tokens are sampled: the prefill worker's first token would arrive without
    its logprob and its prompt logprobs would stay there, so such requests prefill on their decode worker."""
    return params.logprobs is not None or params.prompt_logprobs is not None
