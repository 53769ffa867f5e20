"""Where a worker's engine loop spends its time: inside `engine.step()` against the gaps between two busy steps.

A served engine is slower than the offline one when something else holds the loop between steps (handing
outputs to streams, posted calls such as state commits, threads that take the GIL). The loop records both sides
so the difference is a number: cumulative counters for Prometheus and, every `log_every_s` while busy, one INFO
line with the window's percentiles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hybridserve.engine.step_timing import PHASES, StepTiming

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


class LoopStats:
    """Step and gap times of one engine loop. Written by the loop thread only; read by scrapes (plain floats)."""

    def __init__(self, name: str, log_every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if log_every_s <= 0:
            raise ValueError(f"log_every_s must be > 0, got {log_every_s}")
        self.name = name
        self.log_every_s = log_every_s
        self._clock = clock
        self._lock = threading.Lock()  # the window lists are swapped out by the logger
        self.steps = 0
        self.step_seconds = 0.0
        self.gap_seconds = 0.0  # between the end of one busy step's hand-off and the next step's start
        self.gaps = 0  # back-to-back pairs of steps (gap_seconds / gaps is the mean gap)
        self.outputs = 0
        # steps without prefill tokens, apart: their time is what a served inter-token latency is made of
        self.decode_only_steps = 0
        self.decode_only_seconds = 0.0
        self.decode_only_rows = 0
        self.decode_only_phase_seconds = dict.fromkeys(PHASES, 0.0)  # where those steps' time went
        self._last_end: float | None = None
        self._window_start = clock()
        self._window_steps: list[float] = []
        self._window_gaps: list[float] = []
        self._window_outputs = 0

    def idle(self) -> None:
        """The loop ran out of work: the next step's wait is idleness, not overhead."""
        self._last_end = None

    def record(self, start: float, stepped: float, num_outputs: int, timing: StepTiming | None = None) -> None:
        """One step ran from `start` to `stepped` (clock values) and produced `num_outputs` outputs (`timing`: the
        engine's shape and phases of it); called after they were handed to their streams, so the hand-off counts
        as gap before the next step."""
        step = stepped - start
        gap = start - self._last_end if self._last_end is not None else None
        with self._lock:
            self.steps += 1
            self.step_seconds += step
            self.outputs += num_outputs
            if timing is not None and timing.decode_only:
                self.decode_only_steps += 1
                self.decode_only_seconds += step
                self.decode_only_rows += timing.decode_rows
                for name, seconds in zip(PHASES, timing.phases()):
                    self.decode_only_phase_seconds[name] += seconds
            self._window_steps.append(step)
            self._window_outputs += num_outputs
            if gap is not None:
                self.gap_seconds += gap
                self.gaps += 1
                self._window_gaps.append(gap)
        now = self._clock()
        self._last_end = now
        if now - self._window_start >= self.log_every_s:
            self._flush(now)

    def _flush(self, now: float) -> None:
        with self._lock:
            steps, gaps, outputs = self._window_steps, self._window_gaps, self._window_outputs
            self._window_steps, self._window_gaps, self._window_outputs = [], [], 0
        span = now - self._window_start
        self._window_start = now
        if not steps:
            return
        steps.sort()
        gaps.sort()
        gap_text = (f"between steps p50 {_percentile(gaps, 0.5) * 1e3:.2f} / p99 {_percentile(gaps, 0.99) * 1e3:.2f} ms"
                    if gaps else "no back-to-back steps")
        logger.info(
            "%s (last %.1f s): %d steps, step p50 %.2f / p99 %.2f ms, %s, busy %.0f%% in steps, %.1f outputs/step",
            self.name, span, len(steps), _percentile(steps, 0.5) * 1e3, _percentile(steps, 0.99) * 1e3, gap_text,
            100.0 * sum(steps) / span if span > 0 else 0.0, outputs / len(steps),
        )
