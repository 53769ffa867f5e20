"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token, its log-probability and rank, and the most likely tokens there (id, logprob)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step; `finished` once a stop condition hit."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS or a stop token) | "length" (max_tokens / max_model_len) | None
    num_cached_tokens: int
    finished: bool
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed for this request
    num_accepted_tokens: int = 0  # ... and accepted by the target
    # with SamplingParams.logprobs: one per output token; with prompt_logprobs: one per prompt token (None for the
    # first, which nothing predicts), filled as the prefill computes them
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
