"""The router's view of its workers: stubs, last health (load + cache geometry), breakers, event subscribers.

A poller refreshes every worker's Health (all in parallel, each under a deadline); the routing policy reads
the latest snapshot without blocking. Worker sets can be replaced at any time (Ray restarts move workers);
in-flight requests keep the handles they started with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from hybridserve.proto import common_pb2, worker_pb2_grpc
from hybridserve.proto.channels import channel_options, internal_channel
from hybridserve.proto.internal_auth import TOKEN_METADATA
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.router.cache_subscriber import CacheSubscriber
from hybridserve.router.circuit_breaker import CircuitBreaker
from hybridserve.router.config import ResilienceConfig
from hybridserve.router.prefix_index import PrefixIndex
from hybridserve.router.seat_queue import SeatQueue
from hybridserve.router.session_socket import SocketSessionCall
from hybridserve.router.worker_session import SessionError, WorkerSession

logger = logging.getLogger(__name__)

STALLED_STATUS = "stalled"  # a worker's Health.status when its engine holds requests and makes no progress
SOCKET_RETRY_S = 60.0  # after a socket session failed to open, the worker's sessions go over gRPC this long

def channel(address: str, internal_token: str | None = None, internal_tls: InternalTlsConfig | None = None) -> grpc.Channel:
    """The router's channel to a worker (sending the internal token on every call when there is one; mutual
    TLS when enabled). The cache-event subscription runs on the same channel."""
    return internal_channel(address, internal_token, tls=internal_tls)


def aio_channel(address: str, internal_tls: InternalTlsConfig | None = None) -> grpc.aio.Channel:
    """The router's grpc.aio channel to a worker, for the request path on the router's event loop (create it
    on that loop); mutual TLS when enabled, as `channel()`. The internal token goes in each call's metadata
    (`WorkerHandle.metadata`): cheaper than an aio interceptor."""
    if internal_tls is not None and internal_tls.enabled:
        return grpc.aio.secure_channel(address, internal_tls.channel_credentials(),
                                       options=channel_options(*internal_tls.channel_options()))
    return grpc.aio.insecure_channel(address, options=channel_options())


def call_metadata(internal_token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every request-path call to a worker carries (None in insecure mode)."""
    return ((TOKEN_METADATA, internal_token),) if internal_token else None


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the router knows it; `key` (its address) names it in the index and in metrics."""

    role: str
    address: str
    stub: Any  # the role's generated gRPC stub (PrefillWorkerStub / DecodeWorkerStub)
    breaker: CircuitBreaker
    health: common_pb2.HealthResponse | None = None
    subscriber: CacheSubscriber | None = field(default=None, repr=False)
    metadata: tuple[tuple[str, str], ...] | None = field(default=None, repr=False)  # of request-path calls
    tls: InternalTlsConfig | None = field(default=None, repr=False)  # mutual TLS of the request-path channel
    seats: SeatQueue = field(default_factory=SeatQueue, repr=False)  # requests waiting for a seat (decode role)
    _aio_stub: Any = field(default=None, repr=False)
    _aio_channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _session: WorkerSession | None = field(default=None, repr=False)
    _socket_retry_at: float = field(default=0.0, repr=False)  # monotonic time before which sessions use gRPC
    # monotonic time of the first health call still unanswered (None: the last one was answered)
    waiting_since: float | None = field(default=None, repr=False)
    unresponsive_after_s: float = field(default=5.0, repr=False)

    def aio_stub(self) -> Any:
        """The role's stub on a grpc.aio channel; made on first use, which must be on the router's loop."""
        if self._aio_stub is None:
            cls = worker_pb2_grpc.PrefillWorkerStub if self.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
            self._aio_channel = aio_channel(self.address, self.tls)
            self._aio_stub = cls(self._aio_channel)
        return self._aio_stub

    def session(self, sockets: bool = True) -> WorkerSession | None:
        """The decode worker's request session (`router/worker_session.py`) if its Health says it serves
        sessions (None: GenerateLocal calls); made on first use, on the loop. Each time it (re)opens it goes
        over the worker's socket session when `sockets` and the worker offers one, else over gRPC."""
        if self.health is None or not self.health.sessions:
            return None
        if self._session is None:
            self._session = WorkerSession(self.address, lambda: self._open_session_call(sockets))
        return self._session

    def _open_session_call(self, sockets: bool) -> Any:
        port = self.health.session_port if self.health is not None else 0
        if sockets and port and time.monotonic() >= self._socket_retry_at and not (self.tls is not None and self.tls.enabled):
            token = dict(self.metadata).get(TOKEN_METADATA) if self.metadata else None
            return SocketSessionCall(self.host, port, token, fallback=self._grpc_session_call,
                                     on_unreachable=self._socket_failed,
                                     worker_id=self.health.worker_id if self.health is not None else "")
        return self._grpc_session_call()

    def _grpc_session_call(self) -> Any:
        return self.aio_stub().Session(metadata=self.metadata)

    def _socket_failed(self, error: SessionError) -> None:
        """The socket session could not be opened (a firewall between router and worker, a refused hello, a
        worker restarting): this handle's sessions go over gRPC for SOCKET_RETRY_S, then the socket is tried
        again."""
        logger.warning("decode worker %s: %s; its sessions go over gRPC for %g s", self.address, error.details(),
                       SOCKET_RETRY_S)
        self._socket_retry_at = time.monotonic() + SOCKET_RETRY_S

    async def close_aio(self) -> None:
        """Close the session and the aio channel (on the router's loop), if they were made."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        channel, self._aio_channel, self._aio_stub = self._aio_channel, None, None
        if channel is not None:
            await channel.close()

    async def retire_aio(self, timeout_s: float) -> None:
        """After the worker left the set: its session closes once its requests on it are done, then the aio
        channel once its calls in flight are (prefill, reservations, GenerateLocal streams), `timeout_s` in all;
        what is still open then is cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        session = self._session
        if session is not None:
            await session.close_when_idle(timeout_s)
            self._session = None
        channel = self._aio_channel
        if channel is not None:
            await channel.close(grace=max(0.0, deadline - loop.time()))
            self._aio_channel, self._aio_stub = None, None

    @property
    def key(self) -> str:
        return self.address

    @property
    def draining(self) -> bool:
        """The worker said it is shutting down (SIGTERM): no new requests go to it."""
        return self.health is not None and self.health.status == "draining"

    @property
    def unresponsive(self) -> bool:
        """Its health calls have gone unanswered for `unresponsive_after_s` (a frozen process), or it says its
        engine holds requests and makes no progress: no new requests go to it and /ready counts it out."""
        if self.health is not None and self.health.status == STALLED_STATUS:
            return True
        since = self.waiting_since
        return since is not None and time.monotonic() - since > self.unresponsive_after_s

    @property
    def serving(self) -> bool:
        """Healthy for readiness: answered, not draining, not unresponsive, breaker closed."""
        return self.health is not None and not self.draining and not self.unresponsive and self.breaker.available()

    def problem(self) -> str | None:
        """Why it does not count as serving (None when it does), for /ready."""
        if self.health is None:
            return "unreachable"
        if self.draining:
            return "draining"
        if self.health.status == STALLED_STATUS:
            return "engine makes no progress"
        if self.unresponsive:
            return f"health unanswered for {time.monotonic() - (self.waiting_since or 0.0):.0f} s"
        if not self.breaker.available():
            return "circuit breaker open"
        return None

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]


class WorkerSet:
    """Prefill and decode handles, their health poller and cache-event subscribers."""

    def __init__(self, index: PrefixIndex, config: ResilienceConfig, subscribe: bool = True,
                 on_resync=None, internal_token: str | None = None,
                 internal_tls: InternalTlsConfig | None = None) -> None:
        self._index = index
        self._internal_token = internal_token
        self._internal_tls = internal_tls
        self._config = config
        self._subscribe = subscribe
        self._on_resync = on_resync
        self._lock = threading.Lock()
        self.prefill: list[WorkerHandle] = []
        self.decode: list[WorkerHandle] = []
        self._stop = threading.Event()
        self.on_health: list[Callable[[], None]] = []  # run after every health poll (admission's refresh)
        self._poller = threading.Thread(target=self._poll, name="router-health", daemon=True)
        self._poller.start()

    def update(self, prefill_addresses: list[str], decode_addresses: list[str]) -> list[WorkerHandle]:
        """Point at a new set of workers; unchanged addresses keep their handles (and breaker state). Returns
        the handles that left (their cache subscribers are stopped; their request channels are the caller's)."""
        with self._lock:
            old = {(h.role, h.address): h for h in self.prefill + self.decode}
            new_prefill = [old.pop(("prefill", a)) if ("prefill", a) in old else self._handle("prefill", a)
                           for a in prefill_addresses]
            new_decode = [old.pop(("decode", a)) if ("decode", a) in old else self._handle("decode", a)
                          for a in decode_addresses]
            self.prefill, self.decode = new_prefill, new_decode
        for gone in old.values():
            self._retire(gone)
        return list(old.values())

    def _handle(self, role: str, address: str) -> WorkerHandle:
        cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        stub = cls(channel(address, self._internal_token, self._internal_tls))
        handle = WorkerHandle(role, address, stub, CircuitBreaker(self._config.breaker_failures, self._config.breaker_reset_s),
                              metadata=call_metadata(self._internal_token), tls=self._internal_tls,
                              unresponsive_after_s=self._config.unresponsive_after_s)
        if self._subscribe:
            handle.subscriber = CacheSubscriber(address, stub, self._index, self._on_resync)
        return handle

    def _retire(self, handle: WorkerHandle) -> None:
        if handle.subscriber is not None:
            threading.Thread(target=handle.subscriber.stop, daemon=True).start()
        self._index.drop_worker(handle.key)

    def snapshot(self) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        with self._lock:
            return list(self.prefill), list(self.decode)

    def all(self) -> list[WorkerHandle]:
        prefill, decode = self.snapshot()
        return prefill + decode

    def block_size(self) -> int | None:
        """The cache block size the workers report (they serve one model, so they agree)."""
        for handle in self.all():
            if handle.health is not None and handle.health.block_size:
                return int(handle.health.block_size)
        return None

    def capacity(self) -> int:
        """Requests the ready decode workers report they can hold: each its running batch (`max_running`) plus
        one more batch queued on it, at most half its own queue (`max_num_waiting`; the other half absorbs
        requests the router has let go of and the worker still counts, such as aborts in flight). 0: none
        reported yet."""
        total = 0
        for handle in self.snapshot()[1]:
            health = handle.health
            if health is not None and health.status == "ok" and health.max_running:
                total += health.max_running + min(health.max_running, health.max_num_waiting // 2)
        return total

    def poll_once(self) -> None:
        """Refresh every worker's health in parallel."""
        now = time.monotonic()
        calls = []
        for h in self.all():
            if h.waiting_since is None:
                h.waiting_since = now
            calls.append((h, h.stub.Health.future(common_pb2.HealthRequest(), timeout=self._config.control_timeout_s)))
        for handle, future in calls:
            try:
                handle.health = future.result()
                handle.waiting_since = None
                handle.breaker.record_success()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    # a slow answer (health waits for the engine's current step): keep the last snapshot,
                    # a long prefill step must not open the breaker of a worker that is working
                    logger.info("%s worker %s health check: %s", handle.role, handle.address, exc.code())
                    continue
                if handle.health is not None:
                    logger.warning("%s worker %s is unreachable", handle.role, handle.address)
                handle.health = None
                handle.breaker.record_failure()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
                for listener in list(self.on_health):
                    listener()
            except Exception:  # never let the poller die
                logger.exception("health poll failed")
            self._stop.wait(self._config.health_interval_s)

    def close(self) -> None:
        self._stop.set()
        for handle in self.all():
            if handle.subscriber is not None:
                handle.subscriber.stop()
        self._poller.join(timeout=5)
