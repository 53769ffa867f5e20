"""What both front doors share: prompt checks, sampling parameters, and one generation as an async stream.

Generations run on the router's one event loop (the orchestrator's, which the HTTP server shares), so events
never cross threads. Closing or cancelling the async stream (client gone, stop string matched) aborts the
request in the orchestrator, which aborts it on its workers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from hybridserve.common.outputs import TokenLogprob
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.common.tokenizer import Tokenizer
from hybridserve.proto.convert import logprob_from_proto
from hybridserve.router.admission import AdmissionController
from hybridserve.router.chat_template import ChatTemplate
from hybridserve.router.metrics import RouterMetrics
from hybridserve.router.openai_protocol import ApiError
from hybridserve.router.orchestrator import Orchestrator, WorkerError
from hybridserve.router.request_checks import check_sampling, check_text

logger = logging.getLogger(__name__)


GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
}


def worker_error_to_api(exc: WorkerError) -> ApiError:
    """The client's error: its public message (no worker addresses; the full one is logged here)."""
    status, type_, kind = GRPC_TO_HTTP.get(exc.code, (500, "server_error", "internal"))
    if status >= 500:
        logger.warning("request failed on the workers (%s): %s", exc.code.name, exc)
    return ApiError(status, exc.public, type_, code=kind)


@dataclass(frozen=True)
class Delta:
    """A slice of one choice's output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., on a first delta


class Frontend:
    """Model identity, tokenizer, limits, admission and the orchestrator behind both front doors."""

    def __init__(self, orchestrator: Orchestrator, model_name: str, tokenizer: Tokenizer | None,
                 chat_template: ChatTemplate | None, vocab_size: int, max_model_len: int,
                 admission: AdmissionController, metrics: RouterMetrics,
                 generation_defaults: dict[str, Any] | None = None) -> None:
        if vocab_size <= 0 or max_model_len <= 1:
            raise ValueError("vocab_size must be > 0 and max_model_len > 1")
        self.orchestrator = orchestrator
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.admission = admission
        self.metrics = metrics
        # SamplingParams field -> the checkpoint's default, for what an HTTP request leaves unset
        self.generation_defaults = dict(generation_defaults or {})
        self.path_warm = True  # False while Router.start warms the serving path: /ready answers 503 meanwhile

    # ---- inputs ----------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text or token-id prompt, checked against the vocabulary; raises ApiError. Text from a
        chat template passes add_special_tokens=False (the template writes BOS itself)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", param=param)
            check_text(prompt, param)  # a lone surrogate: the tokenizer would raise TypeError
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = [int(t) for t in prompt]
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # C-speed check; the list only on error
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                raise ApiError(400, f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param=param)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        return ids

    def max_tokens_for(self, prompt: list[int], requested: int | None, param: str = "max_tokens") -> int:
        """The generation budget; raises ApiError for a prompt or budget beyond the context length."""
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context length is "
                                f"{self.max_model_len} (prompt plus at least one generated token)",
                           param="prompt", code="context_length_exceeded")
        if requested is None:
            return room
        if requested > room:
            raise ApiError(400, f"max_tokens={requested} is too large: the prompt has {len(prompt)} tokens and the "
                                f"context length is {self.max_model_len}, so at most {room} can be generated",
                           param=param, code="context_length_exceeded")
        return requested

    def sampling(self, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
                 stop_token_ids: Sequence[int] | None, ignore_eos: bool, choice: int, **extras: Any) -> SamplingParams:
        """Choice i of n gets seed + i, so seeded choices differ but stay reproducible. `extras`: further
        SamplingParams fields (logprobs, penalties, logit_bias, min_tokens); a bad value is a 400 naming it."""
        bias = extras.get("logit_bias") or {}
        if any(t >= self.vocab_size for t in bias):
            raise ApiError(400, f"logit_bias token ids must be below the vocabulary size {self.vocab_size}",
                           param="logit_bias")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=None if seed is None else seed + choice,
                                    stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos, **extras)
        except ValueError as exc:
            message = str(exc)
            param = next((name for name in ("min_tokens", *extras) if message.startswith(name)), None)
            raise ApiError(400, message, param=param) from exc
        check_sampling(params)  # the gRPC door's checks too (router/request_checks.py)
        return params

    # ---- one generation --------------------------------------------------------------------------
    async def deltas(self, index: int, prompt: list[int], params: SamplingParams, request_id: str,
                     stops: Sequence[str] = ()) -> AsyncGenerator[Delta, None]:
        """One choice as text/token deltas; a stop string ends it (finish "stop") and aborts the rest."""
        try:
            text = TextStream(self.tokenizer, stops, params.include_stop_str_in_output)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="stop") from exc
        events = self.orchestrator.stream(prompt, params, request_id)  # on this loop: the orchestrator's
        try:
            async for event in events:
                if event.finish_reason not in ("", "stop", "length"):
                    logger.warning("request %s ended on its worker (%s): %s", request_id, event.finish_reason,
                                   event.error)
                    raise ApiError(503, f"the worker ended the request ({event.finish_reason}); request id "
                                        f"{request_id} in the server log", "server_error", code="unavailable")
                delta = text.add(event.token_ids)
                finish = "stop" if text.stopped else (event.finish_reason or None)
                if finish and not text.stopped:
                    delta += text.finish()
                # logprobs only when asked for: two list comprehensions per event otherwise build empty lists
                yield Delta(index, delta, list(event.token_ids), finish, event.num_prompt_tokens, event.num_cached_tokens,
                            [logprob_from_proto(e) for e in event.logprobs] if event.logprobs else [],
                            [logprob_from_proto(e) for e in event.prompt_logprobs] if event.prompt_logprobs else [])
                if finish:
                    return
        except WorkerError as exc:
            raise worker_error_to_api(exc) from exc
        finally:
            await events.aclose()  # an unfinished stream aborts its workers as it unwinds
