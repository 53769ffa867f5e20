"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass


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
