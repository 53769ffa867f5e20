"""Fan-out of a worker's prefix-cache events to any number of gRPC subscribers.

Once a subscriber has come, the engine loop drains the engine's event log into a bounded replay buffer every
`poll_s`, as protobufs, while a forward computes on the GPU (or when it idles): an `EngineLoop` overlap task, so
neither the conversion nor a poller thread's trip to the loop contends for the GIL with a step's launch. Each
subscriber streams from the sequence number it asks for. A subscriber that asks for events already dropped from the
buffer gets `gap=True` and resynchronises.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import grpc

from hybridserve.proto import common_pb2
from hybridserve.worker_runtime.engine_loop import EngineLoop

_KINDS = {
    "block_stored": common_pb2.CacheEvent.BLOCK_STORED,
    "block_removed": common_pb2.CacheEvent.BLOCK_REMOVED,
    "checkpoint_stored": common_pb2.CacheEvent.CHECKPOINT_STORED,
    "checkpoint_removed": common_pb2.CacheEvent.CHECKPOINT_REMOVED,
}


# Replay buffer length. Subscribers follow within a poll (50 ms), so the buffer only covers their lag; one that
# falls further behind gets a gap and resyncs from a snapshot. 65536 protobuf events were 20-37 MB per worker
# that filled over ~8,000 requests: most of the decode worker's RSS growth in the 30-min CPU soak.
FEED_CAPACITY = 4096


class CacheEventFeed:
    def __init__(self, worker_id: str, loop: EngineLoop, capacity: int = FEED_CAPACITY, poll_s: float = 0.05) -> None:
        self.worker_id = worker_id
        self._loop = loop
        self._buffer: deque[common_pb2.CacheEvent] = deque(maxlen=capacity)
        # events drained before the feed existed (the engine's warm-up) are gone: start where the log is now
        self._next_sequence: int = loop.call(lambda: loop.engine.pool.events.next_sequence, timeout=30)
        self._changed = threading.Condition()
        self._poll_s = poll_s
        self._draining = False  # the drain task is on the loop (from the first subscriber on)
        self._last_drain = 0.0  # time.monotonic() of the loop's last drain (loop thread only)

    def _ensure_draining(self) -> None:
        with self._changed:
            if self._draining:
                return
            self._draining = True
        self._loop.add_overlap_task(self._drain_due)

    def _drain_due(self, idle: bool) -> None:
        """On the loop thread: file the engine's new events when `poll_s` has passed since the last drain, or
        at once when the loop idles (nothing else would come to drain them soon)."""
        now = time.monotonic()
        if not idle and now - self._last_drain < self._poll_s:
            return
        self._last_drain = now
        events = self._loop.engine.drain_cache_events()
        if events:
            with self._changed:
                self._append(events)

    def _append(self, events) -> None:
        """File drained engine events into the replay buffer (caller holds `_changed`)."""
        for event in events:
            self._buffer.append(
                common_pb2.CacheEvent(
                    sequence=event.sequence,
                    kind=_KINDS[event.kind.value],
                    block_hash=event.block_hash,
                    parent_hash=event.parent_hash or "",
                    num_tokens=event.num_tokens,
                )
            )
            self._next_sequence = event.sequence + 1
        if events:
            self._changed.notify_all()

    def _since(self, position: int) -> list[common_pb2.CacheEvent]:
        """Buffered events with sequence >= position, oldest first (caller holds `_changed`). Walked from the
        newest end: the buffer holds up to `capacity` events in sequence order and a subscriber asks for the
        last few, so this costs the events returned, not the buffer (a full scan under the lock, many times a
        second, took the GIL from the engine loop in the same process)."""
        events = []
        for event in reversed(self._buffer):
            if event.sequence < position:
                break
            events.append(event)
        events.reverse()
        return events

    def snapshot(self) -> common_pb2.CacheEventBatch:
        """The pool's whole cache as STORED events, consistent with `next_sequence` (drained in the same
        loop call), so a subscriber that missed events can replace its view and stream on from there."""

        def take():
            radix = self._loop.engine.pool.radix
            nodes = radix.nodes() if radix is not None else []
            return self._loop.engine.drain_cache_events(), [
                (n.block_hash.hex(), n.parent.block_hash.hex() if n.parent is not None and n.parent.depth else "",
                 n.depth * radix.block_size, n.checkpoint is not None)
                for n in nodes
            ]

        with self._changed:
            events, nodes = self._loop.call(take, timeout=30)
            self._append(events)
            sequence = self._next_sequence
        out = []
        for block_hash, parent, num_tokens, has_checkpoint in nodes:
            kinds = [common_pb2.CacheEvent.BLOCK_STORED] + ([common_pb2.CacheEvent.CHECKPOINT_STORED] if has_checkpoint else [])
            out += [common_pb2.CacheEvent(sequence=sequence, kind=k, block_hash=block_hash, parent_hash=parent,
                                          num_tokens=num_tokens) for k in kinds]
        return common_pb2.CacheEventBatch(worker_id=self.worker_id, events=out, next_sequence=sequence, snapshot=True)

    def stream(self, since: int, context: grpc.ServicerContext, snapshot: bool = False):
        """Batches of events with sequence >= since (after a snapshot when asked), until the client goes away."""
        self._ensure_draining()
        position = since
        if snapshot:
            batch = self.snapshot()
            position = batch.next_sequence
            yield batch
        while context.is_active():
            with self._changed:
                self._changed.wait_for(lambda: self._next_sequence > position, timeout=1.0)
                events = self._since(position)
                next_sequence = self._next_sequence
            if not events and next_sequence <= position:
                continue
            yield common_pb2.CacheEventBatch(
                worker_id=self.worker_id,
                events=events,
                next_sequence=next_sequence,
                gap=position < (events[0].sequence if events else next_sequence),
            )
            position = next_sequence
