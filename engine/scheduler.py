"""Continuous batching with chunked prefill over the state pool.

Each step: every running request in the decode phase gets one token (oldest first; when KV pages run out
the newest running request is preempted and recomputed later), then prefill chunks share a budget of
`prefill_chunk_size` tokens (less when `max_num_batched_tokens` caps the whole step, decode rows included):
running prefills continue first, then waiting requests are admitted FCFS while
a state slot and pages are free. An admitted request starts after its longest cached prefix (a checkpoint
copied into its own slot), so cached tokens cost no budget. A request that cannot fit now waits; one that
can never fit is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.engine.request import Request, RequestStatus
from hybridserve.statepool.pool import StatePool


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


class Scheduler:
    def __init__(
        self, pool: StatePool, prefill_chunk_size: int, max_num_seqs: int, decode_lookahead: int = 0,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens  # None: no cap beyond the prefill budget
        self.decode_lookahead = decode_lookahead  # speculative decoding: pages for K draft positions per step
        self.prefill_chunk_size = prefill_chunk_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
                if self._make_room(request, request.num_tokens + self.decode_lookahead):
                    decodes.append(request)
        prefills: list[ScheduledChunk] = []
        budget = self.prefill_budget(len(decodes))
        for request in self.running:
            if budget == 0:
                break
            if request.is_decoding:
                continue
            count = min(request.num_pending_tokens, budget)
            if self.pool.reserve(request, request.num_computed_tokens + count):
                prefills.append(ScheduledChunk(request, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.pool.can_admit():
                break
            hit = self.pool.match(request)
            count = min(request.num_tokens - hit.num_tokens, budget)
            if not self.pool.admit(request, hit, hit.num_tokens + count):
                break
            self.waiting.popleft()
            if not request.admitted:
                request.num_cached_tokens = hit.num_tokens
                request.admitted = True
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            prefills.append(ScheduledChunk(request, count))
            budget -= count
        return SchedulerOutput(decodes=decodes, prefills=prefills)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens a step may add beside `num_decodes` decode rows (each computes 1 + lookahead tokens)."""
        budget = self.prefill_chunk_size
        if self.max_num_batched_tokens is not None:
            budget = min(budget, self.max_num_batched_tokens - num_decodes * (1 + self.decode_lookahead))
        return max(budget, 0)

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Reserve pages, preempting newer running requests; False if `request` itself was preempted."""
        while not self.pool.reserve(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Drop the request's state; it goes back to the front of the queue and restarts from the cache."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_tokens, request.draft_probs, request.replay_pending = [], None, 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request)

    def detach(self, request: Request, reason: str) -> None:
        """Mark finished but keep its pages and slot (a prefill worker exports them next)."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its pages and slot (its full blocks stay cached)."""
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
