"""Structured outputs: a grammar (JSON schema, any JSON object, regex, one of several strings) per request,
enforced with xgrammar's token bitmask on the logits before sampling.

xgrammar over llguidance: both compile these grammars; xgrammar's mask fill was the cheaper per token in
bench/results/cpu/structured_output/ and it is the engine vLLM and SGLang default to. A request's
`GrammarMatcher` advances only with tokens the request keeps (`Scheduler.update_from_output`); a verify
step fills one mask per verify position by accepting the drafts before it tentatively and rolling them back,
so rejected drafts never advance it. Grammars compile off the engine loop, in a bounded pool with size limits,
a deadline and a bounded cache by content (engine/grammar_pool.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridserve.common.sampling_params import SamplingParams, StructuredOutput
from hybridserve.engine.grammar_limits import GrammarLimits
from hybridserve.engine.grammar_pool import GrammarPool, Ready

if TYPE_CHECKING:
    from hybridserve.engine.config import EngineConfig


class GrammarBackend:
    """The compiler for one model's vocabulary and its compile pool (engine/grammar_pool.py). Cheap to build: the
    tokenizer and xgrammar's vocabulary tables load on the pool's thread with the first compile, not on the loop."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits | None = None, timeout_s: float = 10.0) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._model_dir = model_dir
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.pool = GrammarPool(self._compile_uncached, limits or GrammarLimits(), timeout_s)

    def _grammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir), local_files_only=True)
                info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self._eos_token_ids)
                # the pool caches by content with a bound; xgrammar's own cache would keep every schema
                self._compiler = self._xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_uncached(self, spec: StructuredOutput) -> Any:
        c = self._grammar_compiler()
        if spec.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json":
            json.loads(spec.spec)
            return c.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        return c.compile_regex("|".join(f"({re.escape(choice)})" for choice in spec.choices))

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh GrammarMatcher; ValueError naming the field for a grammar over a limit, that does not compile
        or does not compile in time (compiled here, waiting, unless the caller prepared it with `pool.wait`)."""
        return self._xgr.GrammarMatcher(self.pool.compiled(spec))  # rollback depth is unlimited in xgrammar >= 0.2

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Mask logits [R, V] in place: row r may only take tokens matchers[r] accepts next (None: unmasked)."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # [R, ceil(V / 32)] int32
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=[i for i, _ in rows])


class Grammars:
    """An engine's structured-output backend, built on first use from any thread (it holds no engine state), and
    the entry for callers that prepare a request's grammar off the engine loop."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int], has_tokenizer: bool,
                 config: EngineConfig) -> None:
        self._args = (model_dir, vocab_size, tuple(eos_token_ids))
        self._has_tokenizer = has_tokenizer
        self._config = config
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                if not self._has_tokenizer:
                    raise ValueError(f"structured outputs need the model's tokenizer; {self._args[0]} ships none")
                self._backend = GrammarBackend(*self._args, self._config.grammar_limits,
                                               self._config.grammar_compile_timeout_s)
            return self._backend

    def prepare(self, params: SamplingParams, ready: Ready | None = None) -> None:
        """Compile the request's grammar on the pool, from a thread other than the loop: blocks until compiled
        (ValueError when over a limit, invalid or past the deadline; CapacityError when the pool is full), or with
        `ready`, returns at once and calls `ready(error or None)` when known."""
        spec = params.structured
        if spec is None:
            if ready is not None:
                ready(None)
            return
        try:
            pool = self.backend().pool
        except ValueError as exc:
            error = ValueError(f"{spec.field}: {exc}")
            if ready is None:
                raise error from None
            ready(error)
            return
        if ready is None:
            pool.wait(spec)
        else:
            pool.when_ready(spec, ready)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.pool.close()


def fill_verify_masks(backend: GrammarBackend, logits: torch.Tensor, matcher: Any, drafts: Sequence[int]) -> None:
    """logits [T, V] of one verify row: position j masked by the grammar after drafts[:j] (tentatively accepted,
    then rolled back; positions after a draft the grammar refuses are never reached and stay as they are)."""
    accepted = 0
    for j in range(len(drafts) + 1):
        backend.apply(logits[j : j + 1], [matcher])
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
