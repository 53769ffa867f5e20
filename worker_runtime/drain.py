"""Graceful drain of a worker (SIGTERM): refuse new requests, let in-flight ones finish, bounded by a timeout.

While draining, Health reports status "draining" (the router stops routing to the worker) and the calls that
start new work (Prefill, Reserve, GenerateLocal) answer UNAVAILABLE, which the router retries on another
worker; requests already running keep streaming. After the drain timeout the leftovers are aborted, so their
clients see an error instead of a cut connection.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

logger = logging.getLogger(__name__)

DRAINING_STATUS = "draining"


class Drain:
    """The in-flight request ids of one worker and whether it is draining."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    def in_flight(self) -> list[str]:
        with self._cond:
            return list(self._in_flight)

    def refuse_new(self, context: grpc.ServicerContext) -> None:
        """Abort a call that would start new work with UNAVAILABLE (retryable elsewhere) while draining."""
        if self._draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down): retry on another worker")

    def begin(self, request_id: str) -> None:
        with self._cond:
            self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1

    def end(self, request_id: str) -> None:
        with self._cond:
            left = self._in_flight.get(request_id, 0) - 1
            if left > 0:
                self._in_flight[request_id] = left
            else:
                self._in_flight.pop(request_id, None)
            self._cond.notify_all()

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        self.begin(request_id)
        try:
            yield
        finally:
            self.end(request_id)

    def drain(self, timeout_s: float, abort: Callable[[str], object]) -> list[str]:
        """Start draining, wait up to `timeout_s` for the in-flight requests, abort the rest; returns their ids."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight, max(0.0, deadline - time.monotonic()))
            left = list(self._in_flight)
        if left:
            logger.warning("drain timeout (%.0f s): aborting %d requests still in flight", timeout_s, len(left))
        for request_id in left:
            try:
                abort(request_id)
            except Exception as exc:  # the loop may be gone already; the server's stop ends the call anyway
                logger.warning("could not abort %s while draining: %s", request_id, exc)
        if left:  # the aborted streams send their last event
            with self._cond:
                self._cond.wait_for(lambda: not self._in_flight, 5.0)
        return left
