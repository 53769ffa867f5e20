"""Admission that queues: as many requests run as the workers report they can hold; the rest wait in arrival
order (as vLLM's scheduler queue does) for as long as their client waits, up to `max_queued` of them; only
past that bound is a request refused (429 with Retry-After). A free place goes to the oldest waiter, so a
request arriving later never overtakes one that waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.router.config import AdmissionConfig
from hybridserve.router.metrics import RouterMetrics

# requests that run while no worker has reported its capacity yet (the first health poll answers within
# health_interval_s of start-up; requests that find no worker fail on their own)
UNREPORTED_CAPACITY = 256


class Overloaded(RuntimeError):
    """The request was not admitted; `retryable_after_s` is a hint for Retry-After."""

    def __init__(self, message: str, queue_full: bool) -> None:
        super().__init__(message)
        self.queue_full = queue_full  # True: 429 (queue full); False: 503 (waited too long / draining)
        self.retryable_after_s = 1


def client_key(authorization: str | None, address: str) -> str:
    """Who a request comes from, for the per-client limit: its API key (hashed) or, without one, its address."""
    if authorization:
        return "key:" + hashlib.sha256(authorization.encode()).hexdigest()
    return "addr:" + address


@dataclass(eq=False)
class _Waiter:
    """One queued request: woken with its running place already counted (`granted`)."""

    event: threading.Event | None = None  # a thread waiting in `acquire`
    future: asyncio.Future[None] | None = None  # a task waiting in `acquire_async`
    loop: asyncio.AbstractEventLoop | None = None
    granted: bool = False
    enqueued: float = field(default_factory=time.monotonic)

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
        elif self.future is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(_resolve, self.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AdmissionController:
    """Running places and the FIFO of waiters; thread-safe (both doors run on one loop, drains on others).
    `capacity()`: requests the workers report they can hold (0: none reported yet), used unless
    `config.max_running` fixes the limit; call `refresh()` when it may have grown."""

    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics | None = None,
                 capacity: Callable[[], int] | None = None) -> None:
        self.config = config
        self._metrics = metrics
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running = 0
        self._waiters: deque[_Waiter] = deque()
        self._draining = False
        self._per_client: dict[str, int] = {}
        if metrics is not None:  # read at scrape time: no gauge update on every acquire and release
            metrics.scrape_function("running", lambda: self._running)
            metrics.scrape_function("queued", lambda: len(self._waiters))

    @property
    def limit(self) -> int:
        """Requests that run at once: the fixed max_running, else what the workers report they hold."""
        if self.config.max_running is not None:
            return self.config.max_running
        reported = self._capacity() if self._capacity is not None else 0
        return reported if reported > 0 else UNREPORTED_CAPACITY

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, timeout_s: float) -> bool:
        """Admit nothing new (503); wait up to `timeout_s` for the running and queued requests to finish.
        Returns whether they did."""
        with self._cond:
            self._draining = True
        return self.wait_idle(timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no request runs or queues (admitting as usual); returns whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0 and not self._waiters, timeout_s)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def refresh(self) -> None:
        """The limit may have grown (a worker reported more capacity): let waiters in."""
        with self._cond:
            self._grant()

    def try_acquire(self, client: str | None = None) -> bool:
        """Take a running place if one is free and nobody waits (no waiting; safe on an event loop); `client`:
        who asks, for the per-client limit (Overloaded past it)."""
        with self._cond:
            self._check(client)
            if self._running >= self.limit or self._waiters:
                return False
            self._running += 1
            self._count_client(client, 1)
        return True

    def acquire(self, timeout_s: float | None = None, client: str | None = None) -> None:
        """Take a running place, waiting in line on this thread up to `timeout_s` (None: the config's
        queue_timeout_s, None there: as long as it takes); raises Overloaded."""
        waiter = self._enqueue(client, _Waiter(event=threading.Event()))
        if waiter is None:
            return
        timeout = self.config.queue_timeout_s if timeout_s is None else timeout_s
        assert waiter.event is not None
        waiter.event.wait(timeout)
        self._settle(waiter, client, timeout)

    async def acquire_async(self, client: str | None = None) -> None:
        """Take a running place, waiting in line without a thread up to the config's queue_timeout_s (None: until
        the caller is cancelled, e.g. its client left); raises Overloaded."""
        loop = asyncio.get_running_loop()
        waiter = self._enqueue(client, _Waiter(future=loop.create_future(), loop=loop))
        if waiter is None:
            return
        assert waiter.future is not None
        timeout = self.config.queue_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except asyncio.CancelledError:
            with self._cond:
                if waiter.granted:  # the place came as the caller left: hand it on
                    self._release(client)
                else:
                    self._leave(waiter, client)
            raise
        except TimeoutError:
            pass
        self._settle(waiter, client, timeout)

    def release(self, client: str | None = None) -> None:
        with self._cond:
            self._release(client)

    # ---- internals (called with the lock held unless said) ----------------------------------------
    def _enqueue(self, client: str | None, waiter: _Waiter) -> _Waiter | None:
        """Run at once (None) or join the line (the waiter); Overloaded when the line is full."""
        with self._cond:
            self._check(client)
            self._count_client(client, 1)  # a queued request counts against its client too
            if self._running < self.limit and not self._waiters:
                self._running += 1
                return None
            if len(self._waiters) >= self.config.max_queued:
                self._count_client(client, -1)
                raise Overloaded(f"the router queue is full ({len(self._waiters)} requests waiting, max_queued="
                                 f"{self.config.max_queued})", queue_full=True)
            self._waiters.append(waiter)
            return waiter

    def _settle(self, waiter: _Waiter, client: str | None, timeout: float | None) -> None:
        """After a wait (not holding the lock): admitted, or out of line with Overloaded."""
        with self._cond:
            if not waiter.granted:
                self._leave(waiter, client)
                raise Overloaded(f"no capacity within {timeout:.1f} s (queue_timeout_s)", queue_full=False)
        if self._metrics is not None:
            self._metrics.queue_wait.observe(time.monotonic() - waiter.enqueued)

    def _leave(self, waiter: _Waiter, client: str | None) -> None:
        self._waiters.remove(waiter)
        self._count_client(client, -1)
        self._cond.notify_all()

    def _release(self, client: str | None) -> None:
        self._count_client(client, -1)
        self._running -= 1
        self._grant()
        self._cond.notify_all()  # a drain waiting for zero

    def _grant(self) -> None:
        """Hand free running places to the oldest waiters."""
        while self._waiters and self._running < self.limit:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._running += 1
            waiter.wake()

    def _check(self, client: str | None) -> None:
        if self._draining:
            raise Overloaded("the router is shutting down", queue_full=False)
        limit = self.config.max_per_client
        if client is not None and limit and self._per_client.get(client, 0) >= limit:
            raise Overloaded(f"this client already has {limit} requests running or queued (the limit per client)",
                             queue_full=True)

    def _count_client(self, client: str | None, delta: int) -> None:
        if client is None or not self.config.max_per_client:
            return
        left = self._per_client.get(client, 0) + delta
        if left > 0:
            self._per_client[client] = left
        else:
            self._per_client.pop(client, None)
