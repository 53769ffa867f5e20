"""OpenAI `logprobs` bodies from the workers' per-token logprobs: the completions shape (tokens,
token_logprobs, top_logprobs, text_offset; with echo the prompt's tokens first, the first of them without a
logprob) and the chat shape (content: token, logprob, bytes, top_logprobs). A token's string is its own
decode (a piece of a multi-byte character shows as U+FFFD; `bytes` is exact when the tokenizer maps bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridserve.common.outputs import TokenLogprob
from hybridserve.common.tokenizer import Tokenizer


def token_string(tokenizer: Tokenizer | None, token_id: int) -> str:
    """The token's text; without a tokenizer vLLM's `token_id:N` spelling."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        text_offset: int) -> dict[str, Any]:
    """The completions `logprobs` object for `token_ids` (entries aligned; None: no logprob, the echoed first
    prompt token); `text_offset` is where the first token's text starts in the choice's text."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        text = token_string(tokenizer, token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(entry.logprob)
        top = {token_string(tokenizer, t): v for t, v in entry.top}
        top.setdefault(text, entry.logprob)  # the chosen token is always listed, as vLLM does
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(tokenizer: Tokenizer | None, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_string(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer | None, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object: one content item per generated token with its top alternatives."""
    return {"content": [
        {**_chat_entry(tokenizer, e.token_id, e.logprob),
         "top_logprobs": [_chat_entry(tokenizer, t, v) for t, v in e.top]}
        for e in entries
    ]}
