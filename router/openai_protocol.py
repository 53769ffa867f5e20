"""Request bodies of the OpenAI-compatible API (pydantic), and the OpenAI error body.

Unknown fields and unsupported values are refused with 400 rather than ignored: a client that asks for
something we do not do should find out. Extensions (vLLM's): `top_k`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, and `return_token_ids` (adds `token_ids` to each
choice, and `prompt_token_ids` to the response); transformers' `no_repeat_ngram_size`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from hybridserve.common.sampling_params import MAX_NO_REPEAT_NGRAM, StructuredOutput
from hybridserve.router.tool_calls import forced_call_schema

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20  # top alternatives per position (engine.sampling_params.MAX_LOGPROBS)


def schema_text(schema: Any) -> str:
    """A schema as JSON text, as json.dumps writes it, by the pure-Python encoder: a large schema then holds the
    GIL in 5 ms slices rather than for the whole C-encoded dump, so the router's loop keeps relaying meanwhile."""
    return "".join(json.JSONEncoder().iterencode(schema))


class ApiError(Exception):
    """An error answered as an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    no_repeat_ngram_size: int = Field(0, ge=0, le=MAX_NO_REPEAT_NGRAM)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extra_body spelling
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    return_token_ids: bool = False
    _grammar: tuple[StructuredOutput | None] | None = PrivateAttr(None)  # grammar()'s result once computed

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def structured(self) -> StructuredOutput | None:
        """The grammar the output must follow (response_format or one guided_* field), or None."""
        given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None and not (name == "response_format" and self.response_format
                                                             and self.response_format.type == "text")]
        if len(given) > 1:
            raise ApiError(400, f"give at most one of {', '.join(given)}", param=given[1])
        if not given:
            return None
        name = given[0]
        try:
            if name == "response_format":
                rf = self.response_format
                assert rf is not None
                if rf.type == "json_object":
                    return StructuredOutput("json_object", field=name)
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise ValueError("response_format json_schema needs json_schema.schema")
                return StructuredOutput("json", schema_text(rf.json_schema.schema_), field=name)
            if name == "guided_json":
                spec = self.guided_json if isinstance(self.guided_json, str) else schema_text(self.guided_json)
                return StructuredOutput("json", spec, field=name)
            if name == "guided_regex":
                return StructuredOutput("regex", self.guided_regex or "", field=name)
            return StructuredOutput("choice", choices=tuple(self.guided_choice or ()), field=name)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=name) from exc

    def grammar(self) -> StructuredOutput | None:
        """`structured()`, computed once: it serializes the schema, which for a large one takes a while (the
        HTTP door computes it off its event loop for large bodies)."""
        if self._grammar is None:
            self._grammar = (self.structured(),)
        return self._grammar[0]

    def sampling_extras(self) -> dict[str, Any]:
        """The SamplingParams fields beyond the basic ones, as given."""
        return {"structured": self.grammar(), "stop": tuple(self.stop or ()),
                "include_stop_str_in_output": self.include_stop_str_in_output, "min_tokens": self.min_tokens,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "no_repeat_ngram_size": self.no_repeat_ngram_size,
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()}}

    def with_defaults(self, defaults: dict[str, Any]) -> Any:
        """A copy whose sampling fields the client left unset take the model's generation defaults
        (engine.generation_defaults); a value the client sent always wins."""
        given = self.model_fields_set
        update = {name: value for name, value in defaults.items()
                  if name in type(self).model_fields and name not in given
                  and not (name == "max_tokens" and "max_completion_tokens" in given)}
        return self.model_copy(update=update) if update else self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise ValueError(f"best_of must be in [n, {MAX_N}], got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best choices are known only at the end)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: text prompts and token-id prompts, in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ints = [x for x in p if isinstance(x, int)]  # one pass (this runs on every token-id request)
        if len(ints) == len(p):
            return [ints]
        return [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[arg-type]  # str or id lists


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... are passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self.tool_names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    @property
    def forced_tool(self) -> str | None:
        """'' for tool_choice 'required', the function's name for a named choice, None when not forced."""
        if self.tools and self.tool_choice == "required":
            return ""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def structured(self) -> StructuredOutput | None:
        forced = self.forced_tool
        if forced is None:
            return super().structured()
        if super().structured() is not None:
            raise ApiError(400, "a forced tool_choice cannot be combined with response_format / guided_*",
                           param="tool_choice")
        schema = forced_call_schema([t.model_dump(exclude_none=True) for t in self.tools or []], forced or None)
        return StructuredOutput("json", json.dumps(schema), field="tool_choice")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[int]


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic's error list."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "value_error" and msg.startswith("Value error, "):  # our validators' own words
        msg = msg[len("Value error, "):]
    return (f"{param}: {msg}" if param else msg), param
