"""A lane's work in flight (engine/multiplex.py): a fence on a lane's stream, the point up to which the work queued
there is ordered (a CUDA event), so one lane's work can wait for the other's without the host waiting (on a fake
lane, CPU, a fence is always complete); and the record of each lane's forward between its launch and its results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.engine.model_runner import LaunchedStep
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.engine.sm_partition import Lane, SmSplit
from hybridserve.statepool.pool import PlannedCheckpoint


@dataclass(frozen=True)
class Fence:
    """The work queued on a lane so far: a CUDA event on a real lane; on a fake lane (CPU) always complete."""

    event: torch.cuda.Event | None

    @classmethod
    def after(cls, lane: Lane, timing: bool = False) -> Fence:
        """The work queued on `lane` so far (`timing`: an event that can time GPU work, for `ms_since`)."""
        if lane.stream is None:
            return cls(None)
        event = torch.cuda.Event(enable_timing=timing)
        event.record(lane.stream)
        return cls(event)

    def done(self) -> bool:
        """Whether the GPU has run everything before this fence (never waits)."""
        return self.event is None or bool(self.event.query())

    @classmethod
    def loop_stream(cls, lane: Lane) -> Fence:
        """The work the loop thread queued outside the lanes so far (between-step calls: a committed state, scoring)
        on the current stream: a lane's next launch waits for it."""
        if lane.stream is None:
            return cls(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(lane.stream.device))
        return cls(event)

    def hold(self, lane: Lane) -> None:
        """Work queued on `lane` from now on starts after this fence (no host wait)."""
        if self.event is not None and lane.stream is not None:
            lane.stream.wait_event(self.event)

    def hold_loop(self, device: torch.device) -> None:
        """Work the loop thread queues on its current stream from now on starts after this fence (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)

    def ms_since(self, start: Fence) -> float | None:
        """GPU milliseconds from `start` to this fence (both timing fences, both complete); None on a fake lane."""
        if self.event is None or start.event is None:
            return None
        # the host has the step's results by now, but an event recorded on a green-context stream can still read
        # as pending here (seen on an H200): wait for both (no cost once complete), else time it on the host
        start.event.synchronize()
        self.event.synchronize()
        try:
            return float(start.event.elapsed_time(self.event))
        except RuntimeError:
            return None


@dataclass
class PrefillInFlight:
    """The prefill lane's forward between its launch and its completion."""

    work: SchedulerOutput
    launched: LaunchedStep
    plan: list[PlannedCheckpoint]  # its checkpoints, out of the pool until its commit
    split: SmSplit
    lane: Lane
    start: Fence
    done: Fence
    started: float  # perf_counter at launch
    ready_at: int  # the first iteration whose poll may take it (tests hold a fake lane's completion back)
    aborted: list[str] = field(default_factory=list)  # aborted while in flight: finished once it completed

    @property
    def tokens(self) -> int:
        return sum(c.num_tokens for c in self.work.prefills)


@dataclass(frozen=True)
class DecodeInFlight:
    """The decode lane's step between its launch and its tokens."""

    launched: LaunchedStep
    start: Fence
    done: Fence
    launch_s: float  # host seconds of the launch (on a fake lane: the whole forward)
    split: SmSplit  # the split whose decode lane runs it
    launched_at: float  # perf_counter when its launch began
