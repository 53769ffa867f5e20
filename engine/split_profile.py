"""Start-up profile of a multiplexed engine's split menu: in every split, synthetic requests run through the real
multiplexed step, so each lane's step is timed on each of its SM counts before the first user request.

Without it the split controller (engine/sm_split.py) knows only the splits the load has visited and extrapolates the
others from priors; a split it predicts wrongly slow is never tried, so its estimate is never corrected. With it
every (lane, SM count) has measured times: prefill at two chunk sizes (the short prompts together and a long one, so
its line in the tokens has a slope) and decode at the profile's rows, two steps alone and then beside the long
prompt's prefill. The warm-up's times are dropped first, and the first split's first pass: their steps compiled
kernels. The requests are ordinary ones, so their pages and slots come and go through the pool; afterwards the
engine is as it was (no cached prefixes, counters or cache events; the engine's seed stream untouched) and the
split the one in effect before. It runs after the warm-up, only where the warm-up does (by default on CUDA).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.multiplex import Multiplexer
from hybridserve.engine.sm_partition import SmSplit
from hybridserve.engine.warmup import WarmupEngine

logger = logging.getLogger(__name__)

SHORT_PROMPT = 8  # tokens of each decoding row's prompt
DECODE_TOKENS = 6  # tokens each decoding row generates: two decode steps alone, then beside the long prompt
ALONE_STEPS = 2


class ProfiledEngine(WarmupEngine, Protocol):
    """The parts of `LLMEngine` the profile drives: the warm-up's, and the running limit."""

    @property
    def max_running(self) -> int: ...


def profile_splits(engine: ProfiledEngine, multiplexer: Multiplexer, rows: int = 8) -> int:
    """Run the profile (module docstring) in every split of `multiplexer`'s menu; returns the steps it took. `rows`
    decoding requests per split, fewer where the running limit is lower. A split whose requests the pool cannot
    take is skipped (logged), as the warm-up skips such prompts: serving refuses them too."""
    start = time.perf_counter()
    vocab = engine.model_config.vocab_size
    eos = set(engine.model_config.eos_token_ids)
    room = engine.max_model_len - DECODE_TOKENS - engine.lookahead - 1  # as the warm-up's longest prompt
    short = max(1, min(SHORT_PROMPT, room))
    long_prompt = max(1, min(engine.config.prefill_chunk_tokens, room))
    rows = max(1, min(rows, engine.max_running - 1))
    back_to = multiplexer.split
    steps = 0

    def prompt(length: int, salt: int) -> list[int]:
        ids = [(7919 * j + salt) % vocab for j in range(length)]
        return [t if t not in eos else (t + 1) % vocab for t in ids]

    def params(max_tokens: int) -> SamplingParams:  # seeded: the engine's own seed stream stays untouched
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, seed=0)

    splits = multiplexer.controller.splits
    multiplexer.controller.forget()  # the warm-up's steps compiled kernels: their times are not the lanes'
    try:
        # the first split runs twice, its first pass forgotten: it compiles what the warm-up did not (measured: a
        # 1,024-token prefill timed at 1,939 ms on 16 SMs, 199 ms there once warm)
        for index, split in enumerate((splits[0], *splits)):
            if index == 1:
                multiplexer.controller.forget()
            multiplexer.pin(split)
            if _add(engine, split, [(prompt(short, 31 * index + row), params(DECODE_TOKENS),
                                     f"split-profile-{index}-{row}") for row in range(rows)]):
                steps += _step_until(engine, lambda: multiplexer.scheduler.decoding_rows() >= rows)
                steps += _step_until(engine, lambda: False, limit=ALONE_STEPS)  # decode with no prefill beside it
                _add(engine, split, [(prompt(long_prompt, 31 * index + rows), params(1),
                                      f"split-profile-{index}-long")])
            steps += _step_until(engine, lambda: not engine.has_unfinished())  # what was added runs out
    finally:
        if multiplexer.in_flight is None:  # else an error stopped a forward midway: it propagates as it is
            multiplexer.pin(None, back_to)
    engine.reset_prefix_cache()
    engine.pool.reset_counters()
    engine.drain_cache_events()
    multiplexer.counters.reset()
    if engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("pd_multiplex: profiled %d splits (%d decoding rows, a %d-token prompt each) in %d steps, %.1f s",
                len(multiplexer.controller.splits), rows, long_prompt, steps, time.perf_counter() - start)
    logger.info("pd_multiplex: split: decode step of %d rows / prefill of %d tokens: %s", rows, long_prompt,
                multiplexer.controller.describe(rows, long_prompt))
    return steps


def _add(engine: ProfiledEngine, split: SmSplit, requests: list[tuple[list[int], SamplingParams, str]]) -> bool:
    """Add the profile's requests; False (logged) when the pool cannot hold them, as the warm-up skips such prompts:
    serving refuses them too."""
    try:
        for prompt, params, request_id in requests:
            engine.add_request(prompt, params, request_id=request_id)
    except ValueError as exc:
        logger.warning("pd_multiplex: split %s not fully profiled: %s", split, exc)
        return False
    return True


def _step_until(engine: ProfiledEngine, done: Callable[[], bool], limit: int | None = None) -> int:
    """Step `engine` until `done()` holds, `limit` steps ran, or nothing is left to run; the steps taken."""
    steps = 0
    while not done() and engine.has_unfinished() and (limit is None or steps < limit):
        engine.step()
        steps += 1
    return steps
