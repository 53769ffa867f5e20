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

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from hybridserve.engine.request import Request, RequestStatus
from hybridserve.statepool.pool import NO_HIT, StatePool, StateSnapshot

if TYPE_CHECKING:
    from hybridserve.engine.step_output import StepOutput


PREPARE_WAITING = 4  # waiting requests whose prompt hashes are computed ahead, while a forward runs


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


@dataclass(frozen=True)
class StepUpdate:
    """What `update_from_output` did: the step's rows with their computed counts before it, and the requests
    that received tokens (in row order; finished ones are marked FINISHED)."""

    rows: list[tuple[Request, int]]  # (request, tokens scheduled), decodes first
    before: list[int]  # per row, num_computed_tokens before the step
    updated: list[Request]


class StepCommit(Protocol):
    """Speculative decoding's part of a step's commit: which rows verified, a state at a checkpoint boundary
    inside the accepted tokens, the state rollback to the last kept token, and the drafter's catch-up over the
    step's tokens (`reserve` gives a request that goes on decoding pages for its next drafts)."""

    def begin_commit(self, decodes: list[Request], before: list[int]) -> None: ...

    def snapshot(self, request: Request, num_tokens: int, row: int) -> None: ...

    def rollback(self, decodes: list[Request], computed: list[int]) -> None: ...

    def catch_up(self, rows: list[tuple[Request, int]], before: list[int], output: StepOutput,
                 reserve: Callable[[Request], bool]) -> None: ...


class Scheduler:
    def __init__(
        self, pool: StatePool, prefill_chunk_size: int, max_num_seqs: int, decode_lookahead: int = 0,
        max_num_batched_tokens: int | None = None, eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
    ) -> None:
        self.pool = pool
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens  # None: no cap beyond the prefill budget
        self.decode_lookahead = decode_lookahead  # speculative decoding: pages for K draft positions per step
        self.prefill_chunk_size = prefill_chunk_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests whose state arrived from a prefill worker while the batch was full: they hold their slot and
        # pages (standby slots) and join the batch, oldest first, as seats free up
        self.landed: deque[Request] = deque()
        self.num_preemptions = 0
        # async scheduling (engine/async_step.py): running requests not to schedule this step (their token in flight
        # is their last by length)
        self.skip: frozenset[Request] | set[Request] = frozenset()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_landed(self, request: Request) -> None:
        """A request whose state was installed (status RUNNING, decoding): it joins the batch now if there is a
        seat, else waits in `landed` ahead of any new admission."""
        if len(self.running) < self.max_num_seqs and not self.landed:
            self.running.append(request)
        else:
            self.landed.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.landed)

    def schedule(self) -> SchedulerOutput:
        while True:
            out = self._schedule_once()
            if not out.is_empty or not self.running or self.skip:  # with `skip`: its rows' tokens free pages next
                return out
            # every running request is stuck waiting for pages held by the others: free the newest
            self._preempt(self.running[-1])

    def _promote_landed(self) -> None:
        """Landed states join the batch, oldest first, while seats are free: at most one per step while requests
        wait for admission (so neither queue starves the other), and only with a page for the next token (a
        state just received is not preempted to make room) unless the batch is empty."""
        limit = 1 if self.waiting else len(self.landed)
        while self.landed and limit and len(self.running) < self.max_num_seqs:
            request = self.landed[0]
            if not self.pool.reserve(request, request.num_tokens + self.decode_lookahead) and self.running:
                return
            self.running.append(self.landed.popleft())
            limit -= 1

    def _schedule_once(self) -> SchedulerOutput:
        decodes = self.schedule_decodes()
        return SchedulerOutput(decodes=decodes, prefills=self.schedule_prefills(self.prefill_budget(len(decodes))))

    def schedule_decodes(self) -> list[Request]:
        """Landed states join the batch, then one row per decoding request, pages reserved for it (newer running
        requests preempted when they run out)."""
        self._promote_landed()
        decodes: list[Request] = []
        pages_for, lookahead, running, skip = self.pool.pages_for, self.decode_lookahead, RequestStatus.RUNNING, self.skip
        for request in list(self.running):
            if skip and request in skip:
                continue
            # is_decoding and the page check inlined: this loop runs once per row per step (1,024 rows)
            computed = request.num_computed_tokens
            needed = len(request.prompt_token_ids) + len(request.output_token_ids)
            if request.status is running and computed > 0 and needed - computed == 1:
                needed += lookahead
                if pages_for(needed) <= len(request.page_ids) or self._make_room(request, needed):
                    decodes.append(request)
        return decodes

    def schedule_prefills(self, budget: int) -> list[ScheduledChunk]:
        """Prefill chunks of up to `budget` tokens in all: running prefills continue first, then waiting requests
        are admitted FCFS while a slot and pages are free (after their longest cached prefix)."""
        prefills: list[ScheduledChunk] = []
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
            if request.num_inflight or not self.pool.can_admit():  # preempted with its last token still on the GPU
                break
            # prompt logprobs need the logits of every prompt position: such a request recomputes its prefix
            hit = self.pool.match(request) if request.params.prompt_logprobs is None else NO_HIT
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
        return prefills

    def prepare_waiting(self) -> None:
        """Hash the prompts of the next requests to admit (while a forward runs), so admitting them is a lookup."""
        for request in itertools.islice(self.waiting, PREPARE_WAITING):
            if not request.num_inflight:  # its hashes would cover a token not known yet
                self.pool.prepare(request)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens a step may add beside `num_decodes` decode rows (each computes 1 + lookahead tokens)."""
        budget = self.prefill_chunk_size
        if self.max_num_batched_tokens is not None:
            budget = min(budget, self.max_num_batched_tokens - num_decodes * (1 + self.decode_lookahead))
        return max(budget, 0)

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Reserve pages, preempting newer running requests; False if `request` itself was preempted."""
        while not self.pool.reserve(request, num_tokens):
            victim = self.preemption_victim()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def preemption_victim(self) -> Request:
        """The running request `_make_room` preempts next: the newest."""
        return self.running[-1]

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
        if request.status is RequestStatus.RUNNING and request in self.landed:
            self.landed.remove(request)
            self.pool.release(request)
        elif request.status is RequestStatus.RUNNING:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ---- after the forward ----------------------------------------------------------------------
    def update_from_output(self, work: SchedulerOutput, output: StepOutput, spec: StepCommit | None = None) -> StepUpdate:
        """Append each row's new token ids (one list per row, speculative or not) up to the first stop, advance
        the computed counts (a verify row computed exactly the tokens it kept), commit the step to the pool
        (cached blocks, checkpoints; `spec` snapshots and rolls back), then finish (or detach, for a request
        whose state is exported next) every request that stopped; last, `spec`'s drafter catches up."""
        rows = [(r, 1) for r in work.decodes] + [(c.request, c.num_tokens) for c in work.prefills]
        before = [r.num_computed_tokens for r, _ in rows]
        stops: dict[int, str] = {}
        plain = output.logprobs is None and output.prompt_logprobs is None and output.num_verify_rows == 0
        for index, (request, count) in enumerate(rows):
            new_tokens = output.new_token_ids[index]
            if plain and len(new_tokens) == 1 and request.grammar is None:  # the common row, without the loop below
                token = new_tokens[0]
                request.output_token_ids.append(token)
                request.num_computed_tokens += count
                reason = self.stop_reason(request, token)
                if reason is not None:
                    stops[index] = reason
                continue
            appended = 0
            logprobs = output.logprobs[index] if output.logprobs is not None else []
            if output.prompt_logprobs is not None and index in output.prompt_logprobs:
                first, entries = output.prompt_logprobs[index]
                have = len(request.prompt_logprobs)
                if first <= have:  # a recompute after preemption repeats positions it already reported
                    request.prompt_logprobs.extend(entries[have - first :])
            for token in output.new_token_ids[index]:
                request.output_token_ids.append(token)
                if request.grammar is not None:
                    request.grammar.accept_token(token)
                if logprobs:
                    request.output_logprobs.append(logprobs[appended])
                appended += 1
                reason = self.stop_reason(request, token)
                if reason is not None:
                    stops[index] = reason
                    break
            # a verify computed the tokens it appended (a stop inside the accepted drafts cuts them)
            request.num_computed_tokens += appended if index < output.num_verify_rows else count
        decodes = list(zip(work.decodes, before))
        if spec is not None:
            spec.begin_commit(work.decodes, before[: len(work.decodes)])
        # the pool hands back the Requests it is given: the snapshot's Request parameter is safe
        snapshot = cast(StateSnapshot, spec.snapshot) if spec is not None else None
        self.pool.commit([r for r, _ in rows], decodes, snapshot)
        if spec is not None:
            spec.rollback(work.decodes, [r.num_computed_tokens - b for r, b in decodes])
        updated: list[Request] = []
        for index, (request, _) in enumerate(rows):
            if not output.new_token_ids[index]:
                continue
            reason = stops.get(index)
            if reason is not None and request.hold_state:
                self.detach(request, reason)
            elif reason is not None:
                self.finish(request, reason)
            updated.append(request)
        if spec is not None:
            spec.catch_up(rows, before, output, self._reserve_drafts)
        return StepUpdate(rows, before, updated)

    def _reserve_drafts(self, request: Request) -> bool:
        """Pages for a decoding request's next verify (its tokens and `decode_lookahead` drafts); False if short."""
        return self.pool.reserve(request, request.num_tokens + self.decode_lookahead)

    def stop_reason(self, request: Request, token: int) -> str | None:
        """Why the request stops after appending `token` (called once per appended token, in order), or None:
        "stop" (EOS, a stop token, a stop string the text now contains), "length"."""
        params = request.params
        if request.stop_text is not None:
            request.stop_text.add((token,))
            if request.stop_text.stopped:
                return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if request.grammar is not None and request.grammar.is_terminated():
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return "length"
        return None
