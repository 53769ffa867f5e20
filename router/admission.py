"""Bounded admission: a fixed number of requests run, a bounded number wait, the rest are refused at once.

Refusing early (429 with the queue full, 503 after waiting too long) keeps latency bounded under overload
instead of letting every request time out deep in the workers.
"""

from __future__ import annotations

import hashlib
import threading
import time

from hybridserve.router.config import AdmissionConfig
from hybridserve.router.metrics import RouterMetrics


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


class AdmissionController:
    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self._metrics = metrics
        self._cond = threading.Condition()
        self._running = 0
        self._queued = 0
        self._draining = False
        self._per_client: dict[str, int] = {}
        if metrics is not None:  # read at scrape time: no gauge update on every acquire and release
            metrics.scrape_function("running", lambda: self._running)
            metrics.scrape_function("queued", lambda: self._queued)

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
            return self._cond.wait_for(lambda: self._running == 0 and self._queued == 0, timeout_s)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return self._queued

    def _check_client(self, client: str | None) -> None:
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

    def try_acquire(self, client: str | None = None) -> bool:
        """Take a running slot if one is free right now (no waiting; safe on an event loop); `client`: who
        asks, for the per-client limit (Overloaded past it)."""
        with self._cond:
            if self._draining:
                raise Overloaded("the router is shutting down", queue_full=False)
            self._check_client(client)
            if self._running >= self.config.max_running or self._queued:
                return False
            self._running += 1
            self._count_client(client, 1)
        return True

    def acquire(self, timeout_s: float | None = None, client: str | None = None) -> None:
        """Take a running slot, waiting in the bounded queue; raises Overloaded."""
        timeout = self.config.queue_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        with self._cond:
            if self._draining:
                raise Overloaded("the router is shutting down", queue_full=False)
            self._check_client(client)
            self._count_client(client, 1)  # a queued request counts against its client too
            if self._running >= self.config.max_running:
                if self._queued >= self.config.max_queued:
                    self._count_client(client, -1)
                    raise Overloaded(f"the router queue is full ({self._queued} requests waiting)", queue_full=True)
                self._queued += 1
                try:
                    if not self._cond.wait_for(lambda: self._running < self.config.max_running, timeout):
                        self._count_client(client, -1)
                        raise Overloaded(f"no capacity within {timeout:.1f} s", queue_full=False)
                finally:
                    self._queued -= 1
            self._running += 1
        if self._metrics is not None:
            self._metrics.queue_wait.observe(time.monotonic() - start)

    def release(self, client: str | None = None) -> None:
        with self._cond:
            self._count_client(client, -1)
            self._running -= 1
            self._cond.notify_all()  # a queued request, and a drain waiting for zero
