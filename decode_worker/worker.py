"""The decode worker: reservations for remote prefill, state import, continuous batching, token streams.

A plain class with a gRPC server (`DecodeWorker.start()`); Ray actors and the process launcher wrap it.
A reservation holds pages and a state slot until its state is committed, it is aborted, or it expires;
a PushState that fails any check frees it and fails the request's token stream — no half-written state
ever joins the batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from pathlib import Path

import grpc

from hybridserve.decode_worker.reservation import Reservation, ReservationBook
from hybridserve.decode_worker.session import WorkerSession
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.handoff import CapacityError
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.models.fingerprint import model_fingerprint
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import start_server, worker_threads
from hybridserve.proto.convert import sampling_from_proto, token_event
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.transfer.grpc_receiver import StateAssembly, receive_stream
from hybridserve.transfer.grpc_wire import add_decode_worker_servicer
from hybridserve.transfer.manifest import TransferError, check_manifest
from hybridserve.transfer.planes import TransferConfig
from hybridserve.transfer.receiver import LandedState, StateReceiver
from hybridserve.worker_runtime.cache_event_feed import CacheEventFeed
from hybridserve.worker_runtime.drain import DRAINING_STATUS, Drain
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.health import HealthAnswer, health_response
from hybridserve.worker_runtime.session_socket import SessionSocketServer
from hybridserve.worker_runtime.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)

DEFAULT_RESERVATION_TIMEOUT_S = 60.0



class DecodeWorker:
    """Engine loop + gRPC server for the decode role."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, host: str = "127.0.0.1", port: int = 0,
                 worker_id: str | None = None, metrics_port: int | None = 0,
                 transfer: TransferConfig | None = None, internal_token: str | None = None,
                 internal_tls: InternalTlsConfig | None = None, session_port: int | None = 0) -> None:
        self.worker_id = worker_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.engine = LLMEngine(model_dir, config)
        self.fingerprint = model_fingerprint(
            model_dir, config.dtype, self.engine.model_config.ssm_state_dtype, config.load_format, config.seed
        )
        self.loop = EngineLoop(self.engine, name=f"{self.worker_id}-loop")
        self.events = CacheEventFeed(self.worker_id, self.loop)
        self.metrics = WorkerMetrics(self.loop, "decode")
        self._metrics_port = metrics_port  # None: no /metrics server
        self._reservations = ReservationBook()
        self.transfer = transfer or TransferConfig()
        self._health_answer = HealthAnswer(self.loop, lambda: health_response(
            "decode", self.worker_id, self.fingerprint, self.engine, self.metrics.port, self.transfer))
        self.receiver = StateReceiver(self.transfer, self.engine.config.torch_device)
        self._internal_token = internal_token  # required on every call to this worker
        self._internal_tls = internal_tls  # mutual TLS on its port when enabled
        self.drain_state = Drain()  # in flight: reservations and token streams
        self._lock = threading.Lock()
        self._host, self._port = host, port
        self._server: grpc.Server | None = None
        # socket sessions (worker_runtime/session_socket.py) on this port of the host (0: a free one; None: none);
        # not with internal TLS, where routers keep the gRPC session
        self._session_sockets: SessionSocketServer | None = None
        if session_port is not None and not (internal_tls is not None and internal_tls.enabled):
            self._session_sockets = SessionSocketServer(
                host, session_port, lambda requests, context: WorkerSession(self, context).run(requests),
                internal_token, name=f"{self.worker_id}-session", worker_id=self.worker_id)
        self._reaper = threading.Thread(target=self._reap_expired, daemon=True)
        self._closed = threading.Event()

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def start(self) -> str:
        self._server, self._port = start_server(
            self._host, self._port, lambda server: add_decode_worker_servicer(DecodeServicer(self), server),
            max_workers=worker_threads(self.engine.config.max_num_seqs), token=self._internal_token,
            tls=self._internal_tls,
        )
        if self._session_sockets is not None:
            self._session_sockets.start()
        self._reaper.start()
        if self._metrics_port is not None:
            self.metrics.start(self._host, self._metrics_port)
        logger.info("decode worker %s serving on %s (transfer planes %s)", self.worker_id, self.address,
                    self.receiver.planes)
        return self.address

    def drain(self, timeout_s: float) -> list[str]:
        """SIGTERM: refuse new requests, let in-flight ones finish up to `timeout_s`, abort the rest (their
        streams end with an error event); returns the aborted ids. Call stop() after."""
        return self.drain_state.drain(timeout_s, self._abort_at_drain_timeout)

    def _abort_at_drain_timeout(self, request_id: str) -> None:
        error = RuntimeError("the decode worker shut down before the request finished (drain timeout)")
        reservation = self._reservations.find(request_id)
        if reservation is not None:
            self.cancel(reservation, error)
        else:
            self.loop.fail(request_id, error)

    def stop(self, grace: float = 1.0) -> None:
        self._closed.set()
        if self._session_sockets is not None:
            self._session_sockets.stop(grace)
        if self._server is not None:
            self._server.stop(grace).wait()
        self.metrics.stop()
        self.loop.stop()
        self.receiver.close()

    # ---- reservations --------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling, timeout_s: float) -> Reservation:
        params = sampling_from_proto(sampling)
        self.engine.grammars.prepare(params)  # compiled off the loop, before the reservation takes pages
        stream = self.loop.submit(request_id, lambda: self.engine.reserve(request_id, prompt_token_ids, params))
        reservation = Reservation(uuid.uuid4().hex, request_id, len(prompt_token_ids), time.monotonic() + timeout_s,
                                  stream, ttl_s=timeout_s)
        self._reservations.add(reservation)
        self.drain_state.begin(request_id)  # until a reader took its stream (handed_over), or it is cancelled
        return reservation

    def take(self, ticket: str) -> Reservation:
        """The open reservation a state transfer names (TransferError when there is none)."""
        return self._reservations.for_state(ticket)

    def claim(self, ticket: str, request_id: str) -> Reservation:
        """A reader takes a reservation's token stream (ReservationBook.claim), before or after its commit. The
        request stays counted in flight under the reservation until the reader calls `handed_over`."""
        return self._reservations.claim(ticket, request_id)

    def handed_over(self, request_id: str) -> None:
        """The claiming reader counts the request in flight itself now: the reservation's count ends."""
        self.drain_state.end(request_id)

    def assembly_for(self, reservation: Reservation, manifest, specs) -> StateAssembly:
        """The receive buffer shared by the parallel streams of one reservation's state."""
        with self._lock:
            if reservation.assembly is None:
                reservation.assembly = StateAssembly(manifest, specs, self.receiver.host_buffers)
            elif not reservation.assembly.same_state(manifest):
                raise TransferError("INVALID_ARGUMENT", "the streams of one state carry different manifests")
            return reservation.assembly

    def check_manifest(self, reservation: Reservation, manifest, chunked: bool) -> list:
        """The state specs a manifest for `reservation` must match; TransferError otherwise.
        `chunked`: the manifest heads a gRPC stream (its chunk fields must add up)."""
        specs = self.engine.state_specs(reservation.num_tokens)  # cache geometry only: safe off the loop
        specs = check_manifest(manifest, reservation.ticket, self.fingerprint, reservation.num_tokens, specs, chunked)
        if manifest.request_id != reservation.request_id:
            raise TransferError("FAILED_PRECONDITION", "manifest request_id does not match the ticket")
        return specs

    def commit(self, reservation: Reservation, landed: LandedState) -> None:
        """Install a landed, checked state unless the reservation was cancelled meanwhile (abort, expiry).
        The loop's share is one short step: device-local copies into the reserved pages and slot."""
        manifest = landed.manifest
        if not self._reservations.is_open(reservation):
            landed.release()
            raise TransferError("FAILED_PRECONDITION", f"reservation for {reservation.request_id} was cancelled")

        def install() -> None:
            try:
                first = self.engine.commit_reservation(
                    reservation.request_id, landed.tensors, manifest.first_token, manifest.num_cached_tokens
                )
            finally:
                landed.release()  # the copies out of the landing buffer are queued: it may be reused after them
            reservation.stream.put(first)  # on the loop thread: ahead of any output of a later step

        self.loop.call(install)
        self._reservations.settle(reservation)

    def cancel(self, reservation: Reservation, error: BaseException) -> None:
        if not self._reservations.cancel(reservation, str(error)):
            return
        self.loop.call(lambda: self.engine.abort(reservation.request_id))
        reservation.stream.put(error)
        if not reservation.claimed:  # no reader took it (a late one gets the cause): its count and stream end here
            self.drain_state.end(reservation.request_id)
            self.loop.close_stream(reservation.request_id, reservation.stream)

    def abort(self, request_id: str) -> bool:
        """Abort a request, cancelling its reservation if it has one."""
        reservation = self._reservations.find(request_id)
        if reservation is not None:
            self.cancel(reservation, ConnectionAbortedError("aborted"))
            return True
        return bool(self.loop.call(lambda: self.engine.abort(request_id)))

    def _reap_expired(self) -> None:
        while not self._closed.wait(0.5):
            for reservation in self._reservations.expired(time.monotonic()):
                logger.warning("reservation %s for %s expired", reservation.ticket, reservation.request_id)
                self.cancel(reservation, TimeoutError(
                    "no reader claimed the token stream in time" if reservation.committed else
                    "no state arrived before the reservation expired"))

    def health(self) -> common_pb2.HealthResponse:
        health = self._health_answer()
        health.sessions = True
        if self._session_sockets is not None:
            health.session_port = self._session_sockets.port
        if self.drain_state.draining:
            health.status = DRAINING_STATUS
        return health


def _abort(context: grpc.ServicerContext, code: str, message: str) -> None:
    context.abort(getattr(grpc.StatusCode, code), message)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def Reserve(self, request, context):  # noqa: N802 - gRPC method names
        self.worker.drain_state.refuse_new(context)
        timeout = request.timeout_ms / 1000 if request.timeout_ms else DEFAULT_RESERVATION_TIMEOUT_S
        try:
            reservation = self.worker.reserve(request.request_id, list(request.prompt_token_ids), request.sampling, timeout)
        except ValueError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))
        except CapacityError as exc:
            _abort(context, "RESOURCE_EXHAUSTED", str(exc))
        return worker_pb2.ReserveResponse(ticket=reservation.ticket, model_fingerprint=self.worker.fingerprint)

    def PushState(self, request_iterator, context):  # noqa: N802
        reservation: Reservation | None = None

        def open_assembly(manifest):
            nonlocal reservation
            reservation = self.worker.take(manifest.ticket)
            specs = self.worker.check_manifest(reservation, manifest, chunked=True)
            return self.worker.assembly_for(reservation, manifest, specs)

        def land() -> tuple[bool, int]:
            assembly, complete, num_bytes = receive_stream(request_iterator, open_assembly)
            if complete:
                if reservation is None:  # open_assembly ran, so this cannot be; mypy cannot see it
                    raise TransferError("INTERNAL", "a completed state stream without a reservation")
                received = time.time()
                landed = self.worker.receiver.land_host(assembly)
                landed_at = time.time()
                self.worker.commit(reservation, landed)
                logger.info("state of %s: landed in %.1f ms, committed %.1f ms later (at %.3f)", reservation.request_id,
                            (landed_at - received) * 1e3, (time.time() - landed_at) * 1e3, time.time())
            return complete, num_bytes

        complete, num_bytes = _handle_transfer(self.worker, context, lambda: reservation, land)
        return worker_pb2.PushStateResponse(committed=complete, bytes_received=num_bytes)

    def OfferState(self, request, context):  # noqa: N802
        reservation: Reservation | None = None

        def land() -> tuple[bool, int]:
            nonlocal reservation
            reservation = self.worker.take(request.manifest.ticket)
            specs = self.worker.check_manifest(reservation, request.manifest, chunked=False)
            self.worker.commit(reservation, self.worker.receiver.land_offer(request, specs))
            return True, request.manifest.total_bytes

        complete, num_bytes = _handle_transfer(self.worker, context, lambda: reservation, land)
        return worker_pb2.PushStateResponse(committed=complete, bytes_received=num_bytes)

    def TransferInfo(self, request, context):  # noqa: N802
        return self.worker.receiver.transfer_info(request.device)

    def StreamTokens(self, request, context):  # noqa: N802
        try:
            reservation = self.worker.claim(request.ticket, request.request_id)
        except TransferError as exc:
            _abort(context, exc.code, str(exc))
        yield from _events(self.worker, reservation.request_id, reservation.stream, context, local=False,
                           claimed=True)

    def GenerateLocal(self, request, context):  # noqa: N802
        self.worker.drain_state.refuse_new(context)
        try:
            params = sampling_from_proto(request.sampling)
            self.worker.engine.grammars.prepare(params)  # compiled off the loop; this call waits for it
            prompt = list(request.prompt_token_ids)
            hashes = self.worker.engine.pool.prompt_hashes(prompt)  # on this thread, not the engine loop
            stream = self.worker.loop.submit(
                request.request_id,
                lambda: self.worker.engine.add_request(prompt, params, request.request_id, bounded=True,
                                                       block_hashes=hashes),
            )
        except ValueError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))
        except CapacityError as exc:
            _abort(context, "RESOURCE_EXHAUSTED", str(exc))
        yield from _events(self.worker, request.request_id, stream, context, local=True)

    def Session(self, request_iterator, context):  # noqa: N802
        yield from WorkerSession(self.worker, context).run(request_iterator)

    def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def Health(self, request, context):  # noqa: N802
        return self.worker.health()

    def CacheEvents(self, request, context):  # noqa: N802
        yield from self.worker.events.stream(request.since_sequence, context, request.snapshot)


def _handle_transfer(worker: DecodeWorker, context: grpc.ServicerContext, reservation, land):
    """Run one transfer's landing + commit; any failure cancels the reservation (its token stream gets the
    error) and answers with the failure's own gRPC status."""
    try:
        return land()
    except TransferError as exc:
        if (r := reservation()) is not None:
            worker.cancel(r, exc)
        _abort(context, exc.code, str(exc))
    except grpc.RpcError as exc:  # the sender went away mid-stream
        if (r := reservation()) is not None:
            worker.cancel(r, ConnectionError(f"state stream broke: {exc}"))
        raise
    except Exception as exc:
        if (r := reservation()) is not None:
            worker.cancel(r, exc)
        _abort(context, "INTERNAL", f"state import failed: {exc}")
    return False, 0


def _events(worker: DecodeWorker, request_id: str, stream: queue.Queue, context: grpc.ServicerContext,
            local: bool, claimed: bool = False):
    """TokenEvents from a request's output stream; a client that goes away aborts the request. `claimed`: the
    stream was claimed from a reservation, whose in-flight count this reader's replaces."""
    sent = 0
    finished = False
    worker.drain_state.begin(request_id)
    if claimed:
        worker.handed_over(request_id)
    try:
        for out in worker.loop.iterate(request_id, stream):
            finished = out.finished
            # counted before the last event goes out: a client that stops reading after it cancels the call,
            # and the generator is not resumed past that yield
            if out.finished:  # prompt tokens only for prompts this worker prefilled itself
                worker.metrics.observe_finished(len(out.prompt_token_ids) if local else 0, out.num_tokens,
                                                out.finish_reason or "")
            yield token_event(out, sent)
            sent = max(sent, out.num_tokens)
    except (TransferError, TimeoutError, ConnectionError, RuntimeError, ValueError) as exc:
        finished = True
        yield common_pb2.TokenEvent(request_id=request_id, finish_reason="error", error=str(exc))
    finally:
        if not finished:  # the caller went away (or aborted) before the end: counted as an abort
            worker.metrics.observe_finished(0, sent, "abort")
        worker.drain_state.end(request_id)
