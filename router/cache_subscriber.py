"""Keeps the prefix index in step with one worker's CacheEvents stream.

Each subscription starts with a snapshot of the worker's cache (so a router that starts late, or restarts,
sees what is already cached), then applies events while their sequence numbers are contiguous. A gap —
flagged by the worker or seen as a jump in sequence numbers — means events were lost: the subscriber
resubscribes for a fresh snapshot. When the worker is unreachable its entries are dropped (a restarted
worker comes back empty) and the subscription is retried with backoff.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

import grpc

from hybridserve.proto import common_pb2
from hybridserve.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class CacheSubscriber:
    """One thread per worker; `stop()` cancels the stream and joins."""

    def __init__(self, key: str, stub, index: PrefixIndex, on_resync: Callable[[str], None] | None = None) -> None:
        self.key = key
        self._stub = stub
        self._index = index
        self._on_resync = on_resync or (lambda reason: None)
        self._stop = threading.Event()
        self._call = None
        self._lock = threading.Lock()
        self.num_snapshots = 0
        self.ready = threading.Event()  # set once the first snapshot is applied
        self._thread = threading.Thread(target=self._run, name=f"cache-events-{key}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = RETRY_MIN_S
        while not self._stop.is_set():
            try:
                if self._follow():
                    delay = RETRY_MIN_S
                    continue  # a gap: resubscribe at once
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                logger.debug("cache events of %s: %s", self.key, exc.code())
                self._index.drop_worker(self.key)
                self.ready.clear()
            self._stop.wait(delay * random.uniform(0.5, 1.0))
            delay = min(RETRY_MAX_S, delay * 2)

    def _follow(self) -> bool:
        """Stream until a gap (returns True) or the stream ends (returns False)."""
        call = self._stub.CacheEvents(common_pb2.CacheEventsRequest(snapshot=True))
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        expected = None
        for batch in call:
            if batch.snapshot:
                self._index.replace(self.key, batch.events)
                expected = batch.next_sequence
                self.num_snapshots += 1
                self.ready.set()
                continue
            sequences = [e.sequence for e in batch.events]
            contiguous = sequences == list(range(expected, expected + len(sequences))) if expected is not None else False
            if batch.gap or not contiguous:
                logger.warning("cache events of %s lost (expected %s, got %s); resyncing", self.key, expected,
                               sequences[:1])
                self._on_resync("gap")
                call.cancel()
                return True
            self._index.apply(self.key, batch.events)
            expected = batch.next_sequence
        return False
