"""/v1/completions and /v1/chat/completions: requests -> choices -> OpenAI response bodies or SSE chunks.

Every prompt x n choice is its own routed request (id `<request id>-<k>`), run concurrently; their deltas
are merged in arrival order. Usage counts each prompt once; `prompt_tokens_details.cached_tokens` is what
the workers served from their prefix caches (the first choice of each prompt).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from hybridserve.common.outputs import TokenLogprob
from hybridserve.router.frontend import Delta, Frontend
from hybridserve.router.openai_logprobs import chat_logprobs, completion_logprobs
from hybridserve.router.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hybridserve.router.tool_call_stream import ToolCallStream
from hybridserve.router.tool_calls import parse_tool_calls

_DONE = object()


@dataclass
class _Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    streamed: bool = False  # its first SSE chunk went out (the echo goes with it)
    tools: ToolCallStream | None = None  # streaming with tools: the calls found in the text so far
    text_offset: int = 0  # streaming: where the next token's text starts (completions logprobs)


@dataclass
class _Plan:
    """The choices of one API request."""

    request_id: str
    created: int
    prompts: list[list[int]]
    choices: list[_Choice]
    echo_texts: list[str]  # per prompt: what `echo` puts before the completion ("" without echo)
    gens: list[AsyncGenerator[Delta, None]]


class OpenAIService:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    # ---- entry points ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request_id: str):
        req = req.with_defaults(self.frontend.generation_defaults)
        texts = req.prompts()
        prompts = [self.frontend.encode(p) for p in texts]
        plan = self._plan(req, prompts, req.max_tokens, request_id, "cmpl")
        if req.echo:
            tokenizer = self.frontend.tokenizer
            plan.echo_texts = [t if isinstance(t, str) else tokenizer.decode(ids) if tokenizer is not None else ""
                               for t, ids in zip(texts, prompts)]
        return await self._respond(req, plan, chat=False)

    async def chat(self, req: ChatCompletionRequest, request_id: str):
        req = req.with_defaults(self.frontend.generation_defaults)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt, tools)
        plan = self._plan(req, [prompt], req.max_new_tokens, request_id, "chatcmpl")
        return await self._respond(req, plan, chat=True)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of chat messages rendered through the checkpoint's chat template; ApiError 400 if it cannot."""
        template = self.frontend.chat_template
        if template is None:
            raise ApiError(400, "this model has no tokenizer, so chat completions are not available", param="messages")
        rendered = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
        try:
            text = template.render(rendered, add_generation_prompt=add_generation_prompt, tools=tools)
        except ValueError as exc:
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
        return self.frontend.encode(text, param="messages", add_special_tokens=False)

    def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize answer: the ids the server would run, their count and the context length."""
        if req.messages is not None:
            ids = self.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            assert req.prompt is not None  # the request model requires one of the two
            ids = self.frontend.encode(req.prompt)
        return {"count": len(ids), "max_model_len": self.frontend.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize answer: the text of the ids (out-of-vocabulary ids are a 400)."""
        f = self.frontend
        if f.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: nothing to detokenize with", param="tokens")
        bad = [t for t in req.tokens if not 0 <= t < f.vocab_size]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {f.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": f.tokenizer.decode(req.tokens)}

    # ---- planning --------------------------------------------------------------------------------
    def _plan(self, req, prompts: list[list[int]], max_tokens: int | None, request_id: str, prefix: str) -> _Plan:
        f = self.frontend
        choices, gens = [], []
        budgets = [f.max_tokens_for(p, max_tokens) for p in prompts]  # validate all before starting any
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            prompt_logprobs = None
        else:
            logprobs = req.logprobs
            prompt_logprobs = req.logprobs if req.echo else None
        candidates = _candidates(req)
        if candidates > req.n and logprobs is None:
            logprobs = 0  # best_of ranks candidates by their cumulative logprob
        for p_index, (prompt, budget) in enumerate(zip(prompts, budgets)):
            for k in range(candidates):
                index = p_index * candidates + k
                params = f.sampling(budget, req.temperature, req.top_p, req.top_k, req.seed, req.stop_token_ids,
                                    req.ignore_eos, k, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    **req.sampling_extras())
                choices.append(_Choice(index, p_index))
                gens.append(f.deltas(index, prompt, params, f"{request_id}-{index}", req.stop or ()))
        return _Plan(f"{prefix}-{request_id}", int(time.time()), prompts, choices, [""] * len(prompts), gens)

    async def _respond(self, req, plan: _Plan, chat: bool):
        merged = plan.gens[0] if len(plan.gens) == 1 else _merge(plan.gens)  # one choice: its own stream, no relay
        try:
            first = await merged.__anext__()  # errors before the first token become plain HTTP errors
        except StopAsyncIteration:
            first = None
        except BaseException:
            await merged.aclose()
            raise
        if req.stream:
            return self._sse(req, plan, merged, first, chat)
        try:
            if first is not None:
                _fold(plan, first)
            async for delta in merged:
                _fold(plan, delta)
        finally:
            await merged.aclose()
        return self._body(req, plan, chat)

    # ---- bodies ----------------------------------------------------------------------------------
    @staticmethod
    def _message(req, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The assistant message of a chat choice: its tool calls when the request has tools and the text holds
        calls (NemotronH's <TOOLCALL> format or a JSON call object), else the text."""
        if not getattr(req, "parses_tool_calls", False):
            return {"role": "assistant", "content": text}
        content, calls = parse_tool_calls(text, req.tool_names)
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content,
                "tool_calls": [call.body() for call in calls]}

    def _completion_logprobs(self, req, plan: _Plan, c: _Choice, token_ids: list[int], entries: list[TokenLogprob],
                             offset: int, with_prompt: bool) -> dict | None:
        """The completions logprobs of these tokens; with echo (on the first chunk) the prompt's come first."""
        if req.logprobs is None:
            return None
        ids: list[int] = list(token_ids)
        aligned: list[TokenLogprob | None] = list(entries)
        if req.echo and with_prompt:
            ids = plan.prompts[c.prompt_index] + ids
            aligned = [None, *c.prompt_logprobs] + aligned
        return completion_logprobs(self.frontend.tokenizer, ids, aligned, offset)

    def _usage(self, plan: _Plan) -> dict:
        prompt_tokens = sum(len(p) for p in plan.prompts)
        completion = sum(len(c.token_ids) for c in plan.choices)
        cached = sum(next(c.num_cached_tokens for c in plan.choices if c.prompt_index == i)
                     for i in range(len(plan.prompts)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def _body(self, req, plan: _Plan, chat: bool) -> dict:
        out = []
        for c in _best(req, plan):
            if chat:
                message = self._message(req, c.text, c.finish_reason)
                choice = {"index": c.index, "message": message,
                          "logprobs": chat_logprobs(self.frontend.tokenizer, c.logprobs) if req.logprobs else None,
                          "finish_reason": "tool_calls" if message.get("tool_calls") else c.finish_reason}
            else:
                choice = {"index": c.index, "text": plan.echo_texts[c.prompt_index] + c.text,
                          "logprobs": self._completion_logprobs(req, plan, c, c.token_ids, c.logprobs, 0, True),
                          "finish_reason": c.finish_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        body: dict[str, Any] = {"id": plan.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": plan.created, "model": self.frontend.model_name, "choices": out, "usage": self._usage(plan)}
        if req.return_token_ids:
            body["prompt_token_ids"] = plan.prompts if len(plan.prompts) > 1 else plan.prompts[0]
        return body

    async def _sse(self, req, plan: _Plan, merged: AsyncGenerator[Delta, None], first: Delta | None, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": plan.request_id, "object": obj, "created": plan.created, "model": self.frontend.model_name,
                    "choices": choices, **usage_field, **extra}
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        try:
            if chat:  # the role first, as OpenAI does
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in plan.choices])
            delta = first
            while delta is not None:
                _fold(plan, delta)
                c = plan.choices[delta.index]
                opening, c.streamed = not c.streamed, True
                if chat:
                    if req.parses_tool_calls:  # content, then each call's name and its arguments as they arrive
                        if c.tools is None:
                            c.tools = ToolCallStream(req.tool_names)
                        tool_delta = c.tools.feed(delta.text)
                        finish = delta.finish_reason
                        if finish:
                            tool_delta = _joined(tool_delta, c.tools.finish())
                            # a call cut off by max_tokens stays "length", as the unparsable non-streamed one
                            finish = "tool_calls" if c.tools.has_calls and finish == "stop" else finish
                        if tool_delta or finish:
                            yield chunk([{"index": delta.index, "delta": tool_delta, "logprobs": None,
                                          "finish_reason": finish}])
                        delta = await anext(merged, None)
                        continue
                    choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": (chat_logprobs(self.frontend.tokenizer, delta.logprobs) if req.logprobs
                                           else None),
                              "finish_reason": delta.finish_reason}
                else:
                    echo = plan.echo_texts[c.prompt_index] if opening else ""
                    logprobs = self._completion_logprobs(req, plan, c, delta.token_ids, delta.logprobs,
                                                         c.text_offset, opening)
                    if logprobs is not None:
                        c.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) \
                            if logprobs["tokens"] else c.text_offset
                    choice = {"index": delta.index, "text": echo + delta.text, "logprobs": logprobs,
                              "finish_reason": delta.finish_reason}
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                yield chunk([choice])
                delta = await anext(merged, None)
            if req.include_usage:
                yield chunk([], usage=self._usage(plan))
        except ApiError as exc:  # after the headers: report in-band, as OpenAI does
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two chat deltas as one: content concatenated, tool_calls entries in order."""
    out = dict(first)
    if second.get("content"):
        out["content"] = out.get("content", "") + second["content"]
    if second.get("tool_calls"):
        out["tool_calls"] = out.get("tool_calls", []) + second["tool_calls"]
    return out


def _candidates(req) -> int:
    """Generations per prompt: best_of (completions) or n."""
    return getattr(req, "best_of", None) or req.n


def _best(req, plan: _Plan) -> list[_Choice]:
    """The choices to answer: with best_of > n, each prompt's n candidates of highest cumulative logprob,
    re-indexed in that order (usage still counts every candidate, as OpenAI bills them)."""
    candidates = _candidates(req)
    if candidates == req.n:
        return plan.choices
    chosen = []
    for p_index in range(len(plan.prompts)):
        group = plan.choices[p_index * candidates : (p_index + 1) * candidates]
        group.sort(key=lambda c: sum(e.logprob for e in c.logprobs), reverse=True)
        for k, c in enumerate(group[: req.n]):
            chosen.append(dataclasses.replace(c, index=p_index * req.n + k))
    return chosen


def _fold(plan: _Plan, delta: Delta) -> None:
    c = plan.choices[delta.index]
    c.text += delta.text
    c.token_ids.extend(delta.token_ids)
    c.logprobs.extend(delta.logprobs)
    c.prompt_logprobs.extend(delta.prompt_logprobs)
    c.num_cached_tokens = max(c.num_cached_tokens, delta.num_cached_tokens)
    if delta.finish_reason:
        c.finish_reason = delta.finish_reason


async def _merge(gens: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[Delta, None]:
    """Deltas of all choices as they arrive; closing this cancels (and so aborts) the unfinished ones. The queue
    is bounded so that a client that stops reading stops the reads from the workers (the router's per-stream
    buffer then ends the request)."""
    queue: asyncio.Queue = asyncio.Queue(len(gens))

    async def pump(gen: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in gen:
                await queue.put(delta)
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
