"""The decode worker's side of a router session: many local requests over one bidirectional gRPC stream.

A router opens one `Session` per decode worker and sends each local request as one message on it instead of a
GenerateLocal call of its own. Call set-up and teardown are most of what a relayed request costs in Python gRPC
(bench/results/cpu/router/); on the session a request is one message in, and its tokens leave
in messages shared with every other request of the router (one per engine step at most, not one per request).

Threads: a reader takes requests off the stream and admits them with calls posted to the engine loop (it never
waits for a step boundary, so requests that arrive together start together); the loop puts every output,
tagged with its request id, on one queue; the gRPC handler thread drains that queue and sends what it found
as one `SessionEvents`. The session owns its requests: when the router goes away, the ones still running are
aborted, as a cancelled GenerateLocal call aborts its one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from hybridserve.common.outputs import RequestOutput
from hybridserve.decode_worker.reservation import Reservation
from hybridserve.engine.handoff import CapacityError
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.proto.convert import sampling_from_proto, token_event
from hybridserve.worker_runtime.drain import Drain
from hybridserve.worker_runtime.engine_loop import EngineLoop, OutputSink
from hybridserve.worker_runtime.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often an idle session checks that its router and engine loop are still there
_MAX_BATCH = 4096  # items taken off the shared queue for one message


class SessionHost(Protocol):
    """The decode worker as its sessions see it (decode_worker/worker.py's DecodeWorker, which imports this
    module: a Protocol keeps the two files from importing each other)."""

    engine: LLMEngine
    loop: EngineLoop
    metrics: WorkerMetrics
    drain_state: Drain

    def claim(self, ticket: str, request_id: str) -> Reservation: ...

    def handed_over(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> bool: ...


@dataclass(frozen=True)
class _Refused:
    code: grpc.StatusCode
    message: str
    opened: bool  # counted as open (and in flight for the drain) before it was refused


class _Closed:
    """The router's side of the stream ended (put by the reader)."""


_CLOSED = _Closed()
_Item = RequestOutput | BaseException | _Refused | _Closed


class _Tagged:
    """One request's view of the session queue: what the engine loop puts comes out tagged with its id."""

    __slots__ = ("_outbound", "_request_id")

    def __init__(self, request_id: str, outbound: queue.SimpleQueue[tuple[str, _Item]]) -> None:
        self._request_id, self._outbound = request_id, outbound

    def put(self, item: RequestOutput | BaseException) -> None:
        self._outbound.put((self._request_id, item))


class WorkerSession:
    """One router's session with a decode worker; `run()` is the gRPC handler's response iterator."""

    def __init__(self, worker: SessionHost, context: grpc.ServicerContext) -> None:
        self._worker = worker
        self._context = context
        self._outbound: queue.SimpleQueue[tuple[str, _Item]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # request id -> tokens sent so far (admitted, not yet finished)
        self._remote: set[str] = set()  # open ids whose prompt was prefilled elsewhere (reservations)
        self._sinks: dict[str, OutputSink] = {}  # open id -> the stream the engine loop feeds for it
        self._gone = False  # the RPC ended

    # ---- the reader thread -----------------------------------------------------------------------
    def _read(self, requests: Iterator[worker_pb2.SessionRequest]) -> None:
        try:
            for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "generate":
                    self._admit(request.generate)
                elif kind == "stream_tokens":
                    self._follow(request.stream_tokens)
                elif kind == "abort":
                    self._abort(request.abort.request_id)
        except grpc.RpcError:  # the router went away: run() sees the context end
            pass
        except Exception:  # never leave run() waiting on a dead reader
            logger.exception("session reader failed")
        finally:
            self._outbound.put(("", _CLOSED))

    def _admit(self, request: worker_pb2.GenerateLocalRequest) -> None:
        rid = request.request_id
        worker = self._worker
        if worker.drain_state.draining:
            self._refuse(rid, grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down): retry on another worker")
            return
        sink = _Tagged(rid, self._outbound)
        if not self._open_request(rid, sink, remote=False):
            return
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            self._refuse(rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc), opened=True)
            return
        prompt = list(request.prompt_token_ids)
        hashes = worker.engine.pool.prompt_hashes(prompt)  # here, not on the engine loop

        def add() -> None:
            worker.engine.add_request(prompt, params, rid, bounded=True, block_hashes=hashes)

        def refused(exc: BaseException) -> None:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, CapacityError) else (
                grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else grpc.StatusCode.INTERNAL)
            self._refuse(rid, code, str(exc), opened=True)

        def compiled(error: BaseException | None) -> None:  # the grammar's compile must not hold up this reader
            if error is None:
                with self._lock:
                    still_open = rid in self._open  # not aborted while its grammar compiled
                if still_open:
                    worker.loop.submit_later(rid, add, sink, refused)
            else:
                refused(error)

        worker.engine.grammars.prepare(params, compiled)

    def _follow(self, request: worker_pb2.StreamTokensRequest) -> None:
        """Take over a reservation's token stream: what it output so far and all that follows comes here."""
        from hybridserve.transfer.manifest import TransferError

        rid = request.request_id
        if self._refused_as_open(rid):  # before claiming: the reservation stays for a reader that may still come
            return
        try:
            reservation = self._worker.claim(request.ticket, rid)
        except TransferError as exc:
            self._refuse(rid, getattr(grpc.StatusCode, exc.code), str(exc))
            return
        if self._open_request(rid, reservation.stream, remote=True):
            reservation.stream.redirect(_Tagged(rid, self._outbound))
        self._worker.handed_over(rid)  # the session counts it in flight now

    def _refused_as_open(self, rid: str) -> bool:
        """Refuse (ALREADY_EXISTS) a request whose id is already open on this session."""
        with self._lock:
            duplicate = rid in self._open
        if duplicate:
            self._refuse_duplicate(rid)
        return duplicate

    def _refuse_duplicate(self, rid: str) -> None:
        self._refuse(rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running on this session")

    def _open_request(self, rid: str, sink: OutputSink, remote: bool) -> bool:
        """Count a request as open on this session (and in flight for the drain); refused if its id already is."""
        with self._lock:
            if rid in self._open:
                self._refuse_duplicate(rid)
                return False
            self._open[rid] = 0
            self._sinks[rid] = sink
            if remote:
                self._remote.add(rid)
        self._worker.drain_state.begin(rid)
        return True

    def _abort(self, request_id: str, router_gone: bool = False) -> None:
        """Forget the request here at once (what it still outputs goes nowhere); a local one is aborted on the
        loop, behind its admission (posted calls run in order). One prefilled elsewhere is aborted by the
        router's Abort call (its reservation is the anchor, whichever arrives first), unless the router is gone:
        then through the worker here, on a thread of its own (it waits for a step boundary)."""
        with self._lock:
            remote = request_id in self._remote
            sent = self._open.get(request_id, 0)
        if not self._forget(request_id):
            return
        self._worker.metrics.observe_finished(0, sent, "abort")  # a client that left, or the router's abort
        if not remote:
            engine = self._worker.engine
            self._worker.loop.post(lambda: engine.abort(request_id))
        elif router_gone:
            threading.Thread(target=self._worker.abort, args=(request_id,), name="session-abort", daemon=True).start()

    def _refuse(self, request_id: str, code: grpc.StatusCode, message: str, opened: bool = False) -> None:
        self._outbound.put((request_id, _Refused(code, message, opened)))

    # ---- the sender (the gRPC handler thread) ----------------------------------------------------------
    def run(self, requests: Iterator[worker_pb2.SessionRequest]) -> Iterator[worker_pb2.SessionEvents]:
        # the RPC's end (router gone, server stopping) aborts what is open even if grpc never resumes run()
        self._context.add_callback(self._terminated)
        threading.Thread(target=self._read, args=(requests,), name="session-reader", daemon=True).start()
        closed = False
        try:
            while not (closed and not self._open):
                try:
                    first = self._outbound.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._gone or not self._context.is_active():
                        return
                    if self._worker.loop.stopped:
                        self._fail_open("the engine loop stopped before the request finished")
                    continue
                batch = [first]
                while len(batch) < _MAX_BATCH:
                    try:
                        batch.append(self._outbound.get_nowait())
                    except queue.Empty:
                        break
                message, closed_now = self._message(batch)
                closed = closed or closed_now
                if self._gone:
                    return
                if message.events or message.refused:
                    yield message
        finally:
            self._end_open()

    def _message(self, batch: list[tuple[str, _Item]]) -> tuple[worker_pb2.SessionEvents, bool]:
        """One SessionEvents from queued items: one event per request (its newest output: each holds every
        token so far), a finished output or an error ends the request."""
        message = worker_pb2.SessionEvents()
        closed = False
        latest: dict[str, RequestOutput] = {}  # unfinished outputs, sent after the loop
        for rid, item in batch:
            if isinstance(item, _Closed):
                closed = True
            elif isinstance(item, _Refused):
                if item.opened:
                    self._forget(rid)
                message.refused.add(request_id=rid, code=item.code.value[0], message=item.message)
            elif isinstance(item, RequestOutput) and not item.finished:
                latest[rid] = item
            else:  # a finished output or an error: the request's last event
                pending = latest.pop(rid, None)
                if pending is not None and isinstance(item, BaseException):
                    self._send(message, rid, pending)  # the tokens before the error still go out
                self._send(message, rid, item)
        for rid, output in latest.items():
            self._send(message, rid, output)
        return message, closed

    def _send(self, message: worker_pb2.SessionEvents, rid: str, item: RequestOutput | BaseException) -> None:
        """Add the request's event for `item` unless the request is no longer open (refused, aborted, ended)."""
        with self._lock:
            sent = self._open.get(rid)
        if sent is None:
            return
        if isinstance(item, BaseException):
            message.events.append(common_pb2.TokenEvent(request_id=rid, finish_reason="error", error=str(item)))
            self._forget(rid)
            return
        message.events.append(token_event(item, sent))
        if item.finished:  # prompt tokens only for prompts this worker prefilled itself
            with self._lock:
                remote = rid in self._remote
            self._worker.metrics.observe_finished(0 if remote else len(item.prompt_token_ids), item.num_tokens,
                                                  item.finish_reason or "")
            self._forget(rid)
        else:
            with self._lock:
                if rid in self._open:
                    self._open[rid] = max(sent, item.num_tokens)

    def _forget(self, request_id: str) -> bool:
        """Close an open request's stream and drain count; False if it was not open."""
        with self._lock:
            if self._open.pop(request_id, None) is None:
                return False
            self._remote.discard(request_id)
            sink = self._sinks.pop(request_id, None)
        self._worker.loop.close_stream(request_id, sink)
        self._worker.drain_state.end(request_id)
        return True

    def _fail_open(self, reason: str) -> None:
        with self._lock:
            open_ids = list(self._open)
        for rid in open_ids:
            self._outbound.put((rid, RuntimeError(reason)))

    def _terminated(self) -> None:
        self._gone = True
        self._end_open()
        self._outbound.put(("", _CLOSED))  # wake run() if it waits

    def _end_open(self) -> None:
        """The session ended (router gone, worker stopping): abort what it still runs."""
        with self._lock:
            open_ids = list(self._open)
        for rid in open_ids:
            self._abort(rid, router_gone=True)
