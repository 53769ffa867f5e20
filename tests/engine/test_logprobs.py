"""Logprobs (CPU, fp32): sampled-token logprobs are the model's raw log_softmax (vLLM's default: before the
repetition penalty, temperature, top-k), prompt logprobs equal the one-pass prompt logits under chunked
prefill and after a prefix-cache hit, and speculative decoding reports the same logprobs as plain decoding."""

from __future__ import annotations

import pytest
import torch
from checkpoints import BASE_NEMOTRON_H, nemotron_h_mtp, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.logprobs import LOGPROB_FLOOR

VOCAB = BASE_NEMOTRON_H["vocab_size"]
OPTIONS = dict(max_model_len=160, state_block=16, page_size=8, max_num_seqs=4)


def _reference(llm: LLM, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(output), V] the model's raw logprobs at each output position, from one scoring pass."""
    logits = llm.prompt_logits(prompt + output[:-1])[len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(outputs, expected: torch.Tensor, num_top: int) -> None:
    assert outputs.logprobs is not None and len(outputs.logprobs) == len(outputs.token_ids)
    for position, (token, entry) in enumerate(zip(outputs.token_ids, outputs.logprobs)):
        row = expected[position].clamp(min=LOGPROB_FLOOR)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert int((row > row[token] + 1e-4).sum()) + 1 <= entry.rank <= int((row > row[token] - 1e-4).sum()) + 1
        assert len(entry.top) == num_top
        top_ids = [t for t, _ in entry.top]
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), row[top_ids], atol=1e-4, rtol=0)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True, logprobs=2),
    # the repetition penalty changes which token is drawn, not the logprobs reported (vLLM's raw default)
    SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True, logprobs=2),
])
def test_sampled_logprobs_are_the_models_raw_logprobs(params: SamplingParams) -> None:
    llm = LLM(nemotron_h_mtp()[0], **OPTIONS)
    prompts = random_prompts([7, 19], VOCAB, seed=3)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        _check(out, _reference(llm, prompt, out.token_ids, params), params.logprobs or 0)
        if params.greedy and params.repetition_penalty == 1.0:
            assert all(e.rank == 1 and e.top[0][0] == e.token_id for e in out.logprobs or [])
    plain = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=3))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs_with_chunked_prefill_and_a_cached_prefix() -> None:
    llm = LLM(nemotron_h_mtp()[0], prefill_chunk_size=8, **OPTIONS)
    prompt = random_prompts([37], VOCAB, seed=4)[0]
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=2))  # cache the prefix
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.num_cached_tokens == 0  # recomputed, not served from the cache
    expected = torch.log_softmax(llm.prompt_logits(prompt).float(), dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry is not None and entry.token_id == prompt[position] and len(entry.top) == 2
        assert entry.logprob == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_decoding_reports_the_same_logprobs(temperature: float) -> None:
    prompts = random_prompts([5, 17, 30], VOCAB, seed=6)
    spec = LLM(nemotron_h_mtp()[0], speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **OPTIONS)
    plain = LLM(nemotron_h_mtp()[0], **OPTIONS)

    def greedy_drafts(request) -> list[int]:  # the target's own greedy continuation: drafts get accepted
        tokens = list(request.all_token_ids)
        for _ in range(3):
            tokens.append(int(plain.prompt_logits(tokens)[-1].argmax()))
        return tokens[-3:]

    assert spec.engine.spec is not None
    spec.engine.spec.set_drafter(greedy_drafts)
    # sampled rows accept a draft only by chance on this random model: the first seed whose run accepted one
    for seed in range(11, 41):
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=seed, ignore_eos=True, logprobs=2)
        outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
        if sum(o.num_accepted_tokens for o in outs) > 0:
            break
    assert sum(o.num_accepted_tokens for o in outs) > 0, "no seed in 11..40 had a draft accepted"
    for prompt, out in zip(prompts, outs):
        _check(out, _reference(plain, prompt, out.token_ids, params), 2)
    if temperature == 0.0:  # the very same tokens and logprobs as plain decoding
        for prompt, out, ref in zip(prompts, outs, plain.generate(prompt_token_ids=prompts, sampling_params=params)):
            assert out.token_ids == ref.token_ids
            assert [e.logprob for e in out.logprobs or []] == pytest.approx([e.logprob for e in ref.logprobs or []],
                                                                             abs=1e-4)


def test_bad_logprobs_values_are_value_errors() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
