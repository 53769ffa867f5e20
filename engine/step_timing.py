"""One engine step's shape and where its wall time went, for the worker loop's metrics (a served step slower
than the offline one shows which phase grew: host work before the launch, the overlapped cache work, the wait for
the GPU, or the update after it)."""

from __future__ import annotations

import time
from dataclasses import dataclass

PHASES = ("schedule", "launch", "while_running", "wait", "update")


@dataclass(frozen=True)
class StepTiming:
    """Seconds per phase (perf_counter differences) of one step with `decode_rows` decoding requests and
    `prefill_tokens` prompt tokens."""

    decode_rows: int = 0
    prefill_tokens: int = 0
    schedule: float = 0.0  # the scheduler's pick, speculative inputs, checkpoint planning
    launch: float = 0.0  # the forward batch built and the model's forward queued
    while_running: float = 0.0  # the prefix cache's host work, done while the forward runs on the GPU
    wait: float = 0.0  # logits, sampling (and draft acceptance) queued, the wait for the tokens: GPU time not hidden
    update: float = 0.0  # tokens appended, stop rules, the pool's commit, outputs, drafting

    @property
    def decode_only(self) -> bool:
        return bool(self.decode_rows) and not self.prefill_tokens

    def phases(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in PHASES)


NO_STEP = StepTiming()  # a step that ran nothing: no shape, not a decode-only step


class StepClock:
    """Marks one step's phase boundaries as it runs (perf_counter); `timing` turns them into a StepTiming. A step
    whose forward never calls `overlap_started` / `overlap_ended` counts no overlapped work."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.scheduled = self.queued = self.overlapped = self.executed = 0.0

    def schedule_done(self) -> None:
        self.scheduled = time.perf_counter()

    def overlap_started(self) -> None:
        self.queued = time.perf_counter()

    def overlap_ended(self) -> None:
        self.overlapped = time.perf_counter()

    def execute_done(self) -> None:
        self.executed = time.perf_counter()
        if not self.overlapped:
            self.queued = self.overlapped = self.executed

    def timing(self, decode_rows: int, prefill_tokens: int) -> StepTiming:
        return StepTiming(
            decode_rows, prefill_tokens, schedule=self.scheduled - self.start, launch=self.queued - self.scheduled,
            while_running=self.overlapped - self.queued, wait=self.executed - self.overlapped,
            update=time.perf_counter() - self.executed,
        )
