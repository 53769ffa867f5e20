"""A torch.profiler trace of a window of a worker's engine steps, for finding where a served step's time goes.

EngineConfig.profile_dir=DIR (--profile-dir) with profile_steps=FIRST:COUNT[:stack] profiles busy steps FIRST .. FIRST+COUNT-1
of each engine loop in the process (steps counted from 0 after start-up) and writes DIR/<loop>-steps<A>-<B>.json
(a Chrome / Perfetto trace: CPU ops per thread, CUDA kernels, each step marked "engine_step") and a .txt table of the
ops by time; `stack` adds Python frames of every thread (the loop's and the threads sending outputs, so a step
waiting on the GIL shows who held it; slower). As vLLM's VLLM_TORCH_PROFILER_DIR, but a fixed window of steps:
a served benchmark profiles its steady state without an endpoint to call.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.engine.config import EngineConfig, parse_profile_steps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepProfileConfig:
    """Which steps to profile and where the trace goes."""

    directory: Path
    first_step: int
    num_steps: int
    with_stack: bool = False

    def __post_init__(self) -> None:
        if self.first_step < 0 or self.num_steps <= 0:
            raise ValueError(f"profile steps need FIRST >= 0 and COUNT > 0, got {self.first_step}:{self.num_steps}")

    @classmethod
    def from_engine(cls, config: EngineConfig) -> StepProfileConfig | None:
        """The window an engine's config asks for (`profile_dir`, `profile_steps`); None when it profiles nothing."""
        if config.profile_dir is None:
            return None
        first, count, stack = parse_profile_steps(config.profile_steps)
        return cls(Path(config.profile_dir), first, count, stack)


class StepProfiler:
    """Wraps one loop's busy steps: starts torch.profiler at step `first_step`, marks each step, stops and writes
    the trace after `num_steps` (or when the loop stops). Used on the loop thread only."""

    def __init__(self, config: StepProfileConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.steps_seen = 0
        self.trace_path: Path | None = None  # set once written
        self._profile: Any = None
        self._first_profiled = 0

    @contextlib.contextmanager
    def step(self) -> Any:
        """Around one busy step of the loop."""
        if self._profile is None and self.trace_path is None and self.steps_seen == self.config.first_step:
            self._start()
        self.steps_seen += 1
        if self._profile is None:
            yield
            return
        with torch.profiler.record_function("engine_step"):
            yield
        if self.steps_seen - self._first_profiled >= self.config.num_steps:
            self.finish()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, with_stack=self.config.with_stack)
        self._profile.__enter__()
        self._first_profiled = self.steps_seen
        logger.info("%s: profiling steps %d-%d", self.name, self.steps_seen, self.steps_seen + self.config.num_steps - 1)

    def finish(self) -> None:
        """Stop and write the trace (a no-op when nothing is being profiled)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.config.directory.mkdir(parents=True, exist_ok=True)
        stem = f"{self.name}-steps{self._first_profiled}-{self.steps_seen - 1}"
        path = self.config.directory / f"{stem}.json"
        profile.export_chrome_trace(str(path))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (self.config.directory / f"{stem}.txt").write_text(profile.key_averages().table(sort_by=sort, row_limit=60))
        self.trace_path = path
        logger.info("%s: wrote the profile of steps %d-%d to %s", self.name, self._first_profiled,
                    self.steps_seen - 1, path)
