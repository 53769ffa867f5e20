"""Scheduling for an engine that runs a prefill forward and a decode forward at once (engine/multiplex.py).

Each lane gets its own batch and its own token budget: the prefill lane a prefill-only batch of up to
`prefill_budget(0)` tokens (running prompts first, then admissions), the decode lane one row per decoding request.
A request is in one lane at a time: the prefill lane takes requests short of their last token, the decode lane
those with one token left, and a request whose prefill forward is in flight (`in_flight`) keeps its progress until
that forward completes, so the decode lane never sees it as decoding; nor may it preempt it for pages, since the
forward is still writing them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput


class LaneScheduler(Scheduler):
    """A `Scheduler` with a batch per lane; its plain `schedule` (co-located steps) is unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: dict[int, Request] = {}  # id -> request of the prefill forward in flight

    def schedule_prefill_lane(self) -> SchedulerOutput:
        """A prefill-only batch within the prefill lane's budget (no decode rows take a share of it)."""
        return SchedulerOutput(decodes=[], prefills=self.schedule_prefills(self.prefill_budget(0)))

    def schedule_decode_lane(self) -> SchedulerOutput:
        """A decode-only batch: every decoding request (a request in flight in the prefill lane is not decoding)."""
        return SchedulerOutput(decodes=self.schedule_decodes(), prefills=[])

    def load(self) -> tuple[int, int]:
        """(prompt tokens the prefill lane can take, rows decoding): what the SM split controller weighs. Waiting
        prompts count only while the batch has a seat for them (a full batch admits none, whatever the SMs)."""
        waiting = decoding = 0
        for request in self.running:
            if request.is_decoding:
                decoding += 1
            else:
                waiting += request.num_pending_tokens
        if len(self.running) < self.max_num_seqs:
            waiting += sum(r.num_pending_tokens for r in self.waiting)
        return waiting, decoding

    def decoding_rows(self) -> int:
        return sum(1 for r in self.running if r.is_decoding)

    def hold(self, requests: Iterable[Request]) -> None:
        """These requests' prefill forward is in flight: never preempted until `release_held`."""
        self.in_flight = {id(r): r for r in requests}

    def release_held(self) -> None:
        self.in_flight = {}

    def preemption_victim(self) -> Request:
        """The newest running request whose prefill is not in flight (pages being written are not taken)."""
        return next(r for r in reversed(self.running) if id(r) not in self.in_flight)

    def unblock(self) -> None:
        """Neither lane could schedule anything and nothing is in flight: every running request waits for pages
        the others hold, so the newest is preempted (as `schedule` does co-located)."""
        if self.running:
            self._preempt(self.running[-1])
