"""Shared set-up of the prefix-cache tests: tiny checkpoints, engines with small pools, cold references."""

from __future__ import annotations

import functools
from pathlib import Path

from checkpoints import mamba2, nemotron_h

from hybridserve import LLM, SamplingParams

STATE_BLOCK = 16  # two SSD chunks of the tiny checkpoints (chunk_size 8)
MAX_MODEL_LEN = 160


def model_dir(kind: str) -> Path:
    return nemotron_h("M*-M")[0] if kind == "nemotron_h" else mamba2()[0]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_llm(kind: str, **overrides: object) -> LLM:
    options = dict(max_model_len=MAX_MODEL_LEN, state_block=STATE_BLOCK, page_size=8, max_num_seqs=4)
    return LLM(model_dir(kind), **{**options, **overrides})


@functools.cache
def _cold_llm(kind: str) -> LLM:
    return LLM(model_dir(kind), max_model_len=MAX_MODEL_LEN, page_size=8, enable_prefix_caching=False)


@functools.lru_cache(maxsize=4096)
def cold_tokens(kind: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of the prompt run alone without the cache (the oracle)."""
    out = _cold_llm(kind).generate(prompt_token_ids=[list(prompt)], sampling_params=greedy(max_tokens))[0]
    assert out.num_cached_tokens == 0
    return out.token_ids
