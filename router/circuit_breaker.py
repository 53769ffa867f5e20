"""Per-worker circuit breaker: stop sending work to a worker that keeps failing, probe it now and then.

closed -> (breaker_failures consecutive failures) -> open -> (reset_s elapsed) -> half-open: one request
is let through; its success closes the breaker, its failure opens it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or reset_s <= 0:
            raise ValueError("a circuit breaker needs failures >= 1 and reset_s > 0")
        self._failures_to_open = failures
        self._reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return HALF_OPEN if self._clock() - self._opened_at >= self._reset_s else OPEN

    def available(self) -> bool:
        """Whether the worker may be picked now (without taking the half-open probe)."""
        with self._lock:
            state = self._state()
            return state == CLOSED or (state == HALF_OPEN and not self._probing)

    def acquire(self) -> bool:
        """Take permission to send one request; in half-open only one caller gets it."""
        with self._lock:
            state = self._state()
            if state == CLOSED:
                return True
            if state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._probing = 0, None, False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self._failures_to_open:
                self._opened_at = self._clock()
            self._probing = False
