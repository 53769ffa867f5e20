"""Warm-up before a worker reports ready: synthetic requests run through the real engine loop so every Triton
kernel is compiled (and autotuned) for the launch families serving will hit, instead of the first user
requests stalling for seconds on it.

Triton specializes a launch on its integer arguments (== 1, divisible by 16, other) and on its constexprs;
the autotuned kernels key on model shapes only. So the plan varies what changes between steps: one and many
sequences, token counts of 1 / multiples of 16 / others, fresh and resumed (cache hit) prefills, prefill
chunks with and without decode rows beside them, checkpoint writes, greedy and random sampling. Decode steps
of every batch bucket were already compiled when the CUDA graphs were captured. Compiled kernels and
autotune timings persist in Triton's cache directory (TRITON_CACHE_DIR), so a restart on the same machine
skips the compiling. Afterwards the engine is as it was: no requests, no cached prefixes, no pending events.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from hybridserve.common.model_config import ModelConfig
from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.statepool.events import CacheEvent
from hybridserve.statepool.pool import StatePool

logger = logging.getLogger(__name__)

MAX_WARMUP_TOKENS = 3  # generated per request: a prefill step, then mixed and decode-only steps


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran (logged at start-up, and read by tests)."""

    num_requests: int
    num_steps: int
    prompt_lens: tuple[int, ...]
    seconds: float
    skipped: tuple[int, ...] = ()  # prompt lengths the pool or max_model_len could not take


class WarmupEngine(Protocol):
    """The parts of `LLMEngine` the warm-up drives (a Protocol: the engine imports this module, not the reverse)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def lookahead(self) -> int: ...
    @property
    def state_block(self) -> int: ...
    @property
    def pool(self) -> StatePool: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def reset_prefix_cache(self) -> None: ...

    def drain_cache_events(self) -> list[CacheEvent]: ...


def warmup_rounds(engine: WarmupEngine) -> list[list[int]]:
    """Prompt lengths per round; a round's requests are added together and run to completion.

    1. many sequences at once, of lengths 1, 16, 17, ... up to two prefill chunks and a checkpoint boundary:
       a packed multi-sequence prefill, then steps mixing prefill chunks with decode rows;
    2. the longest prompt again with a new tail (prefix caching: a resumed prefill from a checkpoint);
    3. one sequence of two whole prefill chunks (a chunk ending on a checkpoint, then a resumed chunk: the
       shape of every long prompt served alone), one of half a chunk (a lone prompt prefilled in one step,
       what an idle server's first request usually is), then single sequences of an odd and of one token."""
    config = engine.config
    limit = engine.max_model_len - MAX_WARMUP_TOKENS - engine.lookahead - 1
    chunk = engine.model_config.mamba.chunk_size if engine.model_config.mamba is not None else 16
    wanted = [1, 16, 17, chunk + 1, config.prefill_chunk_tokens + 3, engine.state_block + chunk + 5]
    many = sorted({max(1, min(n, limit)) for n in wanted})
    rounds = [many]
    if config.enable_prefix_caching and many[-1] > engine.state_block:
        rounds.append([-many[-1]])  # negative: the longest prompt of round 1 with a different tail
    rounds.append([max(1, min(2 * config.prefill_chunk_tokens, limit))])
    rounds.append([max(1, min(config.prefill_chunk_tokens // 2, limit))])
    rounds.append([min(33, limit)])
    rounds.append([1])
    return rounds


def warm_up(engine: WarmupEngine, show_progress: bool = True) -> WarmupReport:
    """Run the warm-up rounds through `engine` and leave it clean; returns what ran."""
    start = time.perf_counter()
    vocab = engine.model_config.vocab_size
    eos = set(engine.model_config.eos_token_ids)
    generator = torch.Generator().manual_seed(1234)

    def prompt(length: int) -> list[int]:
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        return [t if t not in eos else (t + 1) % vocab for t in ids]

    rounds = warmup_rounds(engine)
    longest: list[int] = []
    lens: list[int] = []
    skipped: list[int] = []
    steps = 0
    total = sum(len(r) for r in rounds)
    with tqdm(total=total, desc="warm-up", unit="req", disable=not show_progress) as bar:
        for round_index, lengths in enumerate(rounds):
            ids = []
            for index, length in enumerate(lengths):
                tokens = longest[:-3] + prompt(3) if length < 0 else prompt(length)
                if length > 0 and length == max(lengths):
                    longest = tokens
                # the sampler's three paths run: greedy, plain temperature (Gumbel-max), top-p (inverse CDF)
                params = SamplingParams(max_tokens=MAX_WARMUP_TOKENS, ignore_eos=True, seed=index,
                                        temperature=0.0 if index % 3 == 0 else 0.8,
                                        top_p=0.9 if index % 3 == 2 else 1.0)
                try:
                    ids.append(engine.add_request(tokens, params, request_id=f"warmup-{round_index}-{index}"))
                    lens.append(len(tokens))
                except ValueError as exc:  # too long for this pool: serving will refuse it too
                    logger.debug("warm-up skips a %d-token prompt: %s", len(tokens), exc)
                    skipped.append(len(tokens))
                    bar.update(1)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        bar.update(1)
                steps += 1
    engine.reset_prefix_cache()
    engine.pool.reset_counters()
    engine.drain_cache_events()
    if engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    report = WarmupReport(len(lens), steps, tuple(lens), time.perf_counter() - start, tuple(skipped))
    logger.info("warm-up: %d requests (prompt lengths %s), %d steps in %.1f s; Triton cache %s",
                report.num_requests, sorted(set(lens)), steps, report.seconds,
                os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache (default)"))
    return report
