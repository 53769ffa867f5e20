"""logit_bias, min_tokens, the three penalties and no_repeat_ngram_size (CPU, fp32): greedy outputs equal a step-by-step reference
written from the definitions, and speculative decoding with fully accepted drafts gives the same tokens and
logprobs as plain decoding (each verify position sees the drafts before it as output)."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import BASE_NEMOTRON_H, nemotron_h_mtp, random_prompts

from hybridserve import LLM, SamplingParams

VOCAB = BASE_NEMOTRON_H["vocab_size"]
OPTIONS = dict(max_model_len=160, state_block=16, page_size=8, max_num_seqs=4)


def _reference(llm: LLM, prompt: list[int], n: int, presence: float, frequency: float, repetition: float) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = llm.prompt_logits(prompt + out)[-1].float().clone()
        for token in set(prompt + out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


def test_logit_bias_and_min_tokens() -> None:
    llm = LLM(nemotron_h_mtp()[0], **OPTIONS)
    prompt = random_prompts([9], VOCAB, seed=1)
    forced = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={7: 100.0}))[0]
    assert forced.token_ids == [7] * 5
    held = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=8, temperature=0.0, logit_bias={7: 100.0}, stop_token_ids=[7], min_tokens=3))[0]
    assert 7 not in held.token_ids[:3] and held.token_ids[3] == 7 and held.finish_reason == "stop"
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(logit_bias={VOCAB: 1.0}))


def test_penalties_match_their_definitions() -> None:
    llm = LLM(nemotron_h_mtp()[0], **OPTIONS)
    prompt = random_prompts([6], VOCAB, seed=2)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=0.75, repetition_penalty=1.5)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.token_ids == _reference(llm, prompt, 10, 0.5, 0.75, 1.5)


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def test_repeated_ngram_ends_match_a_brute_force_reference() -> None:
    from hybridserve.engine.logits_processors import repeated_ngram_ends

    rng = random.Random(5)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        n = rng.randrange(1, 6)
        seen = set(_ngrams(tokens, n))
        want = sorted(t for t in range(4) if tuple([*tokens, t][-n:]) in seen and len(tokens) >= n - 1)
        assert repeated_ngram_ends(tokens, n) == want, (tokens, n)


def test_no_repeat_ngram_size_leaves_no_ngram_twice() -> None:
    llm = LLM(nemotron_h_mtp()[0], **OPTIONS)
    prompt = random_prompts([6], VOCAB, seed=4)[0]
    looping = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={7: 30.0, 8: 30.0})  # a forced loop
    loose = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**looping))[0].token_ids
    assert len(set(_ngrams(prompt + loose, 3))) < len(_ngrams(prompt + loose, 3)), "no loop to break"
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        **looping, no_repeat_ngram_size=3))[0].token_ids
    grams = _ngrams(prompt + out, 3)
    assert len(out) == 40 and len(set(grams)) == len(grams)


def test_speculative_decoding_processes_each_position_like_plain_decoding() -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={3: 0.5}, logprobs=1,
                            no_repeat_ngram_size=4)
    prompts = random_prompts([5, 21], VOCAB, seed=3)
    plain = LLM(nemotron_h_mtp()[0], **OPTIONS).generate(prompt_token_ids=prompts, sampling_params=params)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    spec = LLM(nemotron_h_mtp()[0], speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **OPTIONS)
    assert spec.engine.spec is not None
    spec.engine.spec.set_drafter(lambda r: truth[tuple(r.prompt_token_ids)][len(r.output_token_ids):][:3])
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
        assert out.num_accepted_tokens > 0
        assert [e.logprob for e in out.logprobs or []] == pytest.approx([e.logprob for e in ref.logprobs or []],
                                                                         abs=1e-4)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_tokens", 17), ("logit_bias", {1: 101.0}), ("logit_bias", {"x": 1.0}), ("no_repeat_ngram_size", -1),
    ("no_repeat_ngram_size", 65), ("no_repeat_ngram_size", 2.0),
])
def test_bad_values_are_value_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})  # type: ignore[arg-type]


def test_unprocessed_rows_are_left_alone() -> None:
    from hybridserve.engine.logits_processors import process_logits

    logits = torch.randn(2, 10)
    assert process_logits(logits, [SamplingParams(), SamplingParams()], [([1], []), ([2], [])], ()) is logits
