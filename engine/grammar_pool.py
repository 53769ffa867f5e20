"""Structured-output grammars compiled off the engine loop: a bounded thread pool, a deadline per request, and a
bounded cache of compiled grammars keyed by their content.

A compile runs in C++ with the GIL released (xgrammar), so a pool thread costs the engine loop no Python time; the
threads run at the lowest CPU priority so that, on a machine with few cores, the running streams' steps come
first. A request waits for its grammar outside the engine (its caller's thread, or a callback) and is refused
with a ValueError when the grammar is over a size limit (engine/grammar_limits.py), does not compile, or is not
compiled by its deadline (the compile is then abandoned: cancelled if it had not started, its result dropped).
Threads, not processes: a compiled grammar is a C++ object the engine's matchers point into, and pickling it
across processes would cost what the thread saves.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from hybridserve.common.sampling_params import StructuredOutput
from hybridserve.engine.grammar_limits import GrammarLimits
from hybridserve.engine.handoff import CapacityError

logger = logging.getLogger(__name__)

_SOURCE_PREFIX = re.compile(r"\[[\d:]+\]\s*\S+:\d+:\s*")  # xgrammar's log prefix: time, C++ file and line
Ready = Callable[[BaseException | None], None]  # called once: None when the grammar is compiled, else the error


def _lowest_priority() -> None:
    """Pool thread initializer: this thread (Linux nice is per thread) yields the CPU to the engine loop."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the compile still runs
        pass


class GrammarPool:
    """Compiles grammars with `compile_fn` on `threads` pool threads; at most `max_pending` compiles queue
    (CapacityError beyond), `cache_entries` compiled grammars are kept (least recently used dropped)."""

    def __init__(self, compile_fn: Callable[[StructuredOutput], Any], limits: GrammarLimits, timeout_s: float,
                 threads: int = 2, max_pending: int = 64, cache_entries: int = 256) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be > 0 s, got {timeout_s!r}")
        self.limits = limits
        self.timeout_s = timeout_s
        self._compile_fn = compile_fn
        self._max_pending = max_pending
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[StructuredOutput, concurrent.futures.Future] = collections.OrderedDict()
        self._pending = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile",
                                                               initializer=_lowest_priority)
        self.num_compiled = self.num_refused = self.num_abandoned = 0  # counters for tests and metrics

    def _future(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """The cached or newly submitted compile of `spec` (limits checked first: ValueError)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
        try:
            self.limits.check(spec)
        except ValueError:
            self.num_refused += 1
            raise
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                return future
            if self._pending >= self._max_pending:
                raise CapacityError(f"{self._pending} grammars are compiling on this worker already; try later")
            self._pending += 1
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._settled(spec, f))
        return future

    def _compile(self, spec: StructuredOutput) -> Any:
        try:
            return self._compile_fn(spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
            message = _SOURCE_PREFIX.sub("", str(exc)).strip()  # "[12:00:00] /project/cpp/x.cc:94: " is no help
            raise ValueError(f"{spec.field} does not compile to a grammar: {message}") from exc

    def _settled(self, spec: StructuredOutput, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1
            failed = future.cancelled() or future.exception() is not None
            if failed and self._cache.get(spec) is future:  # errors are not cached: the next try compiles again
                del self._cache[spec]
            if not failed:
                self.num_compiled += 1

    def _abandon(self, spec: StructuredOutput, future: concurrent.futures.Future) -> ValueError:
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]
        future.cancel()  # still queued: it never runs; running: it finishes on its thread and is dropped
        self.num_abandoned += 1
        logger.warning("%s: grammar compile abandoned after %.1f s", spec.field, self.timeout_s)
        return ValueError(f"{spec.field}: the grammar did not compile within {self.timeout_s:g} s (this server's "
                          "limit); use a smaller schema or pattern")

    def when_ready(self, spec: StructuredOutput, ready: Ready) -> None:
        """Call `ready(None)` once `spec` is compiled, or `ready(error)` (ValueError, CapacityError) when it is
        refused, fails or passes its deadline; on the pool's or a timer's thread, or here when known now."""
        try:
            future = self._future(spec)
        except (ValueError, CapacityError) as exc:
            ready(exc)
            return
        if future.done():
            ready(_error_of(future))
            return
        once = threading.Lock()

        def settle(error: BaseException | None) -> None:
            if once.acquire(blocking=False):
                timer.cancel()
                ready(error)

        timer = threading.Timer(self.timeout_s, lambda: settle(self._abandon(spec, future)))
        timer.daemon = True
        timer.start()
        future.add_done_callback(lambda f: settle(_error_of(f)))

    def wait(self, spec: StructuredOutput | None) -> None:
        """Block this (caller's, not the engine loop's) thread until `spec` is compiled; raises its error."""
        if spec is None:
            return
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def ready(error: BaseException | None) -> None:
            outcome.append(error)
            done.set()

        self.when_ready(spec, ready)
        done.wait()
        if outcome[0] is not None:
            raise outcome[0]

    def compiled(self, spec: StructuredOutput) -> Any:
        """The compiled grammar (waiting here for it when not prepared: the offline `LLM` path); ValueError."""
        future = self._future(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._abandon(spec, future) from None
        except concurrent.futures.CancelledError:
            raise ValueError(f"{spec.field}: the grammar compile was abandoned") from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _error_of(future: concurrent.futures.Future) -> BaseException | None:
    if future.cancelled():
        return ValueError("the grammar compile was abandoned")
    return future.exception()
