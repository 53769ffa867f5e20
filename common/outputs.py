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


class RequestOutput:
    """The state of one request after a step (read-only); `finished` once a stop condition hit.

    `token_ids` is the request's output so far. The engine hands over its own append-only token list and the
    count that belongs to this step (`num_tokens`); the list is copied only when `token_ids` is read, so a step's
    outputs cost the engine O(1) per request instead of O(tokens so far), and a stream sends `new_token_ids(sent)`.
    Entries below `num_tokens` never change after the step (the engine only appends)."""

    __slots__ = ("request_id", "prompt_token_ids", "_tokens", "num_tokens", "_copy", "text", "finish_reason",
                 "num_cached_tokens", "finished", "num_draft_tokens", "num_accepted_tokens", "logprobs",
                 "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int], text: str | None,
                 finish_reason: str | None, num_cached_tokens: int, finished: bool, num_draft_tokens: int = 0,
                 num_accepted_tokens: int = 0, logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, *, num_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._tokens = token_ids
        self.num_tokens = len(token_ids) if num_tokens is None else num_tokens  # output tokens so far
        self._copy: list[int] | None = None
        self.text = text
        self.finish_reason = finish_reason  # "stop" (EOS or a stop token) | "length" (max_tokens / max_model_len)
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished
        self.num_draft_tokens = num_draft_tokens  # speculative decoding: drafts proposed for this request
        self.num_accepted_tokens = num_accepted_tokens  # ... and accepted by the target
        # with SamplingParams.logprobs: one per output token; with prompt_logprobs: one per prompt token (None for
        # the first, which nothing predicts), filled as the prefill computes them
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    @property
    def token_ids(self) -> list[int]:
        """The output token ids so far (a list of their own, made on first read)."""
        if self._copy is None:
            self._copy = self._tokens[: self.num_tokens]
        return self._copy

    def new_token_ids(self, sent: int) -> list[int]:
        """The output token ids after the first `sent` (what a stream that sent `sent` still owes)."""
        return self._tokens[sent : self.num_tokens]

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.text, self.finish_reason,
                self.num_cached_tokens, self.finished, self.num_draft_tokens, self.num_accepted_tokens, self.logprobs,
                self.prompt_logprobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # holds lists, as the dataclass it was

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, text={self.text!r}, "
                f"finish_reason={self.finish_reason!r}, num_cached_tokens={self.num_cached_tokens}, "
                f"finished={self.finished})")
