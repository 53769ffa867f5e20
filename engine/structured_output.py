"""Structured outputs: a grammar (JSON schema, any JSON object, regex, one of several strings) per request,
enforced with xgrammar's token bitmask on the logits before sampling.

xgrammar over llguidance: both compile these grammars; xgrammar's mask fill was the cheaper per token in
bench/results/cpu/structured_mask.json and it is the engine vLLM and SGLang default to. A request's
`GrammarMatcher` advances only with tokens the request keeps (`Scheduler.update_from_output`); a verify
step fills one mask per verify position by accepting the drafts before it tentatively and rolling them back,
so rejected drafts never advance it. Compiled grammars are cached per spec.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridserve.common.sampling_params import StructuredOutput


class GrammarBackend:
    """The compiler for one model's vocabulary; built on the first structured request (it loads the tokenizer)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def _compile_uncached(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        if spec.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json":
            return c.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        return c.compile_regex("|".join(f"({re.escape(choice)})" for choice in spec.choices))

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh GrammarMatcher; ValueError naming the field for a grammar that does not compile."""
        try:
            if spec.kind == "json":
                json.loads(spec.spec)
            compiled = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise ValueError(f"{spec.field} does not compile to a grammar: {exc}") from exc
        return self._xgr.GrammarMatcher(compiled)  # rollback depth is unlimited in xgrammar >= 0.2

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
