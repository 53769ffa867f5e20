"""Continuous batching with chunked prefill.

Each step: every running request in the decode phase gets one token (oldest first; when KV pages run out
the newest running request is preempted and recomputed later), then prefill chunks share a budget of
`prefill_chunk_size` tokens: running prefills continue first, then waiting requests are admitted FCFS while
a state slot and pages are free. A request that cannot fit now waits; one that can never fit is refused
when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.engine.request import Request, RequestStatus
from hybridserve.statepool.allocators import PageAllocator, SlotAllocator


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: decode requests (one token each, batched first) and prefill chunks."""

    decodes: list[Request]
    prefills: list[ScheduledChunk]

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def chunks(self) -> list[tuple[Request, int]]:
        """(request, new tokens) for every scheduled request, decodes first."""
        return [(r, 1) for r in self.decodes] + [(c.request, c.num_tokens) for c in self.prefills]


class Scheduler:
    def __init__(
        self,
        pages: PageAllocator | None,  # None when the model has no attention layers
        slots: SlotAllocator | None,  # None when the model has no Mamba layers
        page_size: int,
        prefill_chunk_size: int,
        max_num_seqs: int,
    ) -> None:
        self.pages = pages
        self.slots = slots
        self.page_size = page_size
        self.prefill_chunk_size = prefill_chunk_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) if self.pages is not None else 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        while True:
            out = self._schedule_once()
            if not out.is_empty or not self.running:
                return out
            # every running request is stuck waiting for pages held by the others: free the newest
            self._preempt(self.running[-1])

    def _schedule_once(self) -> SchedulerOutput:
        decodes: list[Request] = []
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING and request.is_decoding:
                if self._make_room(request, request.num_tokens):
                    decodes.append(request)
        prefills: list[ScheduledChunk] = []
        budget = self.prefill_chunk_size
        for request in self.running:
            if budget == 0:
                break
            if request.is_decoding:
                continue
            count = min(request.num_pending_tokens, budget)
            if self.reserve_pages(request, request.num_computed_tokens + count):
                prefills.append(ScheduledChunk(request, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.slots is not None and not self.slots.can_allocate(1):
                break
            count = min(request.num_pending_tokens, budget)
            if not self.reserve_pages(request, request.num_computed_tokens + count):
                break
            self.waiting.popleft()
            if self.slots is not None:
                request.state_slot = self.slots.allocate(1)[0]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            prefills.append(ScheduledChunk(request, count))
            budget -= count
        return SchedulerOutput(decodes=decodes, prefills=prefills)

    def reserve_pages(self, request: Request, num_tokens: int) -> bool:
        """Make sure the request holds pages for `num_tokens` tokens; False if the pool is short."""
        needed = self.pages_for(num_tokens) - len(request.page_ids)
        if needed <= 0:
            return True
        assert self.pages is not None
        if not self.pages.can_allocate(needed):
            return False
        request.page_ids.extend(self.pages.allocate(needed))
        return True

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Reserve pages, preempting newer running requests; False if `request` itself was preempted."""
        while not self.reserve_pages(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Drop the request's state; it goes back to the front of the queue and is recomputed."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        if self.pages is not None and request.page_ids:
            self.pages.free(request.page_ids)
        request.page_ids = []
        if self.slots is not None and request.state_slot is not None:
            self.slots.free([request.state_slot])
        request.state_slot = None

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its pages and slot."""
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
