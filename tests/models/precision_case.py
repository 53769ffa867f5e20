"""Shared by the precision-option tests: greedy agreement and the largest logprob error of an engine option
against the default (fp32 on CPU) engine, on the same checkpoint and prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridserve import LLM, SamplingParams


@dataclass(frozen=True)
class Agreement:
    """How close an option's engine is to the reference engine."""

    greedy_match: float  # fraction of greedy tokens equal to the reference's, up to each first divergence
    identical: int  # sequences whose greedy outputs are identical
    max_logprob_error: float  # over the reference's sequences, teacher-forced: top-k logprobs of every position


def compare(model_dir: Path, prompts: list[list[int]], option: dict, max_tokens: int = 16, top: int = 5,
            option_model_dir: Path | None = None, **engine: object) -> Agreement:
    """Greedy generation under `option` against the default engine, then both score the reference's
    prompt + output sequences (prompt_logprobs): the largest |logprob| difference over the top entries.
    `option_model_dir`: the option's engine loads this checkpoint instead (an fp8 export of model_dir)."""
    ref_llm = LLM(model_dir, **engine)
    opt_llm = LLM(option_model_dir or model_dir, **engine, **option)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in ref_llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    got = [o.token_ids for o in opt_llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    matched = 0
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        matched += n
    scored = [p + list(o) for p, o in zip(prompts, ref)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=top)
    worst = 0.0
    ref_scores = ref_llm.generate(prompt_token_ids=scored, sampling_params=score)
    opt_scores = opt_llm.generate(prompt_token_ids=scored, sampling_params=score)
    for r, o in zip(ref_scores, opt_scores):
        for er, eo in zip(r.prompt_logprobs or [], o.prompt_logprobs or []):
            if er is None or eo is None:
                continue
            theirs = dict(eo.top)
            theirs[eo.token_id] = eo.logprob
            for token, logprob in [*er.top, (er.token_id, er.logprob)]:
                if token in theirs:
                    worst = max(worst, abs(theirs[token] - logprob))
    return Agreement(matched / sum(len(a) for a in ref), sum(a == b for a, b in zip(ref, got)), worst)
