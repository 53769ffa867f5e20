"""Start-up profile of a multiplexed engine's split menu: in every split, synthetic requests run through the real
multiplexed step, so each lane's step is timed on each of its SM counts before the first user request.

Without it the split controller (engine/sm_split.py) knows only the splits the load has visited and extrapolates the
others from priors; a split it predicts wrongly slow is never tried, so its estimate is never corrected. With it
every (lane, SM count) has measured times: prefill at two chunk sizes (a short prompt and a long one, so its line in
the tokens has a slope) and decode at the profile's rows, alone and beside the long prompt's prefill. The requests
are ordinary ones, so their pages and slots come and go through the pool; afterwards the engine is as it was, and
the split is the controller's initial one again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.multiplex import Multiplexer
from hybridserve.statepool.pool import StatePool

logger = logging.getLogger(__name__)

SHORT_PROMPT = 8  # tokens of each decoding row's prompt
DECODE_TOKENS = 4  # tokens each decoding row generates: its decode steps run alone, then beside the long prompt


class ProfiledEngine(Protocol):
    """The parts of `LLMEngine` the profile drives."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def pool(self) -> StatePool: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_running(self) -> int: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def reset_prefix_cache(self) -> None: ...


def profile_splits(engine: ProfiledEngine, multiplexer: Multiplexer, rows: int = 8) -> int:
    """Run the profile (module docstring) in every split of `multiplexer`'s menu; returns the steps it took. `rows`
    decoding requests per split (at most the engine's running limit less the long prompt)."""
    start = time.perf_counter()
    long_prompt = max(1, min(engine.config.prefill_chunk_tokens, engine.max_model_len - 1))
    rows = max(1, min(rows, engine.max_running - 1))
    initial = multiplexer.controller.current
    steps = 0
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0)
    try:
        for index, split in enumerate(multiplexer.controller.splits):
            multiplexer.pin(split)
            for row in range(rows):
                prompt = [(7 * row + index + j) % 97 + 1 for j in range(SHORT_PROMPT)]
                engine.add_request(prompt, params, request_id=f"split-profile-{index}-{row}")
            steps += _step_until(engine, lambda: multiplexer.decoding_rows() >= rows)
            prompt = [(3 * j + index) % 89 + 1 for j in range(long_prompt)]
            engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
                               request_id=f"split-profile-{index}-long")
            steps += _step_until(engine, lambda: not engine.has_unfinished())
    finally:
        multiplexer.pin(None, initial)
    engine.reset_prefix_cache()
    if engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("pd_multiplex: profiled %d splits (%d decoding rows, a %d-token prompt each) in %d steps, %.1f s",
                len(multiplexer.controller.splits), rows, long_prompt, steps, time.perf_counter() - start)
    return steps


def _step_until(engine: ProfiledEngine, done: Callable[[], bool]) -> int:
    """Step `engine` until `done()` holds or nothing is left to run; the steps taken."""
    steps = 0
    while not done() and engine.has_unfinished():
        engine.step()
        steps += 1
    return steps
