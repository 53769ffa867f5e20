"""Per-request sampling controls, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow: a JSON schema (`spec`, JSON text), any JSON object, a regex (`spec`),
    or one of `choices`. `field` names the API field it came from, for error messages."""

    kind: Literal["json", "json_object", "regex", "choice"]
    spec: str = ""
    choices: tuple[str, ...] = ()
    field: str = "structured_output"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"{self.field}: the kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if self.kind in ("json", "regex") and not self.spec:
            raise ValueError(f"{self.field}: a {self.kind} grammar needs its spec")
        if self.kind == "choice" and (not self.choices or not all(isinstance(c, str) and c for c in self.choices)):
            raise ValueError(f"{self.field}: give at least one non-empty string to choose from")
        object.__setattr__(self, "choices", tuple(self.choices))

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's top_logprobs limit)
MAX_STOP_TOKEN_IDS = 128  # each is checked on every generated token; a client must not make that unbounded
MAX_NO_REPEAT_NGRAM = 64


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. temperature 0 means greedy; top_k -1 (or 0) means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first (matched on the detokenized text)
    include_stop_str_in_output: bool = False  # ... or after it
    ignore_eos: bool = False
    logprobs: int | None = None  # report each output token's logprob and this many top alternatives (0: none)
    prompt_logprobs: int | None = None  # the same for every prompt token (recomputed: no prefix-cache reuse)
    min_tokens: int = 0  # EOS and stop tokens cannot be sampled before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each in [-100, 100]
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; 1 is off; applies to prompt and output tokens
    # > 0: no n-gram of this many tokens occurs twice in prompt + output (transformers' generation field of the
    # same name); breaks greedy loops when set well above the n-grams the text repeats on purpose. 0 is off
    no_repeat_ngram_size: int = 0
    structured: StructuredOutput | None = None  # the output follows this grammar (engine.structured_output)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
                0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {rp!r}")
        n = self.no_repeat_ngram_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NO_REPEAT_NGRAM:
            raise ValueError(f"no_repeat_ngram_size must be an integer in [0, {MAX_NO_REPEAT_NGRAM}] (0: off), got {n!r}")
        try:
            bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias maps token ids to numbers, got {self.logit_bias!r}") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(stops)}")
        object.__setattr__(self, "stop_token_ids", stops)
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", strings)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
