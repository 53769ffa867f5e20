"""A request as the scheduler tracks it: tokens, progress, and the cache resources it holds."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridserve.common.block_hash import BlockHash
from hybridserve.common.outputs import RequestOutput, TokenLogprob
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.engine.ngram_drafter import NgramIndex

if TYPE_CHECKING:
    from hybridserve.statepool.radix_cache import Node


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Tokens [0:num_computed_tokens] have their KV / Mamba state in the cache; the rest still need a forward."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int, arrival: int
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # with params.logprobs, one per output token
        self.prompt_logprobs: list[TokenLogprob | None] = [None]  # with params.prompt_logprobs, filled per chunk
        self.grammar: Any = None  # xgrammar GrammarMatcher of params.structured: advanced by the kept tokens
        self.stop_text: TextStream | None = None  # with params.stop: the output's text, fed token by token
        self.params = params
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix reused from the cache at first admission
        self.admitted = False
        self.page_ids: list[int] = []  # KV pages; the first len(cache_nodes) may be shared cache blocks
        self.state_slot: int | None = None
        self.cache_nodes: list[Node] = []  # radix-cache blocks this request holds a reference on
        self.block_hashes: list[BlockHash] = []  # chained hashes of its full token blocks (grows with outputs)
        self.finish_reason: str | None = None
        self.hold_state = False  # keep pages and slot after finishing, until the state is exported
        self.last_hidden: torch.Tensor | None = None  # [hidden] final hidden state of the last computed token
        # speculative decoding: drafts for the next verify (with their distributions when sampled), the
        # tokens of the last verify a replay rollback still has to fold in, and per-request counts
        self.draft_tokens: list[int] = []
        self.ngram_index: NgramIndex | None = None  # prompt-lookup drafting state, built on first use
        self.draft_probs: torch.Tensor | None = None  # [len(draft_tokens), vocab]
        self.replay_pending = 0
        self.num_draft_tokens = 0
        # async scheduling: output tokens sampled on the device whose values the host does not know yet (their
        # place in output_token_ids holds a placeholder), and whether the request takes the async path at all
        self.num_inflight = 0
        self.plain: bool | None = None
        self.num_accepted_tokens = 0
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        # a numpy copy of page_ids for the batch builder, kept in step as pages are appended (the pool only ever
        # extends the list it gave, or replaces it on admission and release)
        self._pages_of: list[int] | None = None
        self._pages = np.empty(0, dtype=np.int64)
        self._num_pages = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start:end] of prompt + output without joining the two lists (a decode row takes one token)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - n]

    def page_array(self) -> np.ndarray:
        """page_ids as int64 [num_pages]: only the pages appended since the last call are converted."""
        pages = self.page_ids
        if pages is not self._pages_of:
            self._pages_of, self._pages = pages, np.array(pages, dtype=np.int64)
            self._num_pages = len(pages)
        elif len(pages) != self._num_pages:
            grown = len(pages)
            if grown > len(self._pages) or grown < self._num_pages:
                capacity = max(2 * grown, 16)
                buffer = np.empty(capacity, dtype=np.int64)
                buffer[:grown] = pages
                self._pages = buffer
            else:
                self._pages[self._num_pages : grown] = pages[self._num_pages :]
            self._num_pages = grown
        return self._pages[: self._num_pages]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens that still need a forward before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """One token to compute on top of existing state: the cheap recurrent path."""
        return self.num_computed_tokens > 0 and self.num_pending_tokens == 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def output(self, tokenizer: Any | None) -> RequestOutput:
        """The request's state after a step. Text only once it finished (one decode, for `LLM.generate`): streams
        take the ids and detokenize incrementally where the text is needed (the router), not on the engine loop."""
        finished = self.status is RequestStatus.FINISHED
        text = None
        if finished and self.stop_text is not None:  # cut at the stop string (the token ids end with it)
            text = self.stop_text.text + self.stop_text.finish()
        elif finished and tokenizer is not None:
            text = tokenizer.decode(self.output_token_ids)
        params = self.params
        # the token list itself, not a copy (O(1) per row and step): the output owns its first num_tokens entries,
        # which the engine never changes (it only appends; an async step's in-flight placeholder is past them)
        return RequestOutput(
            self.request_id, self.prompt_token_ids, self.output_token_ids, text, self.finish_reason,
            self.num_cached_tokens, finished, self.num_draft_tokens, self.num_accepted_tokens,
            self.output_logprobs[:] if params.logprobs is not None else None,
            self.prompt_logprobs[:] if params.prompt_logprobs is not None else None,
            num_tokens=len(self.output_token_ids) - self.num_inflight,
        )
