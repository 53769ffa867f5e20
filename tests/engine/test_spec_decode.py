"""Speculative decoding (CPU, fp32): greedy output equals plain greedy decoding for every drafter, K and
rollback method, with prefix caching and checkpoints crossed inside speculation; oracle drafts force full
and zero acceptance; the MTP drafter matches a dense torch reference of its math."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from checkpoints import BASE_NEMOTRON_H, nemotron_h_mtp, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.ngram_drafter import NgramIndex, propose_ngram

VOCAB = BASE_NEMOTRON_H["vocab_size"]
OPTIONS = dict(max_model_len=160, state_block=16, page_size=8, max_num_seqs=4)
PROMPT_LENS = [5, 17, 30, 9]  # mixed lengths; 16-token state blocks get crossed during speculation


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@functools.cache
def reference(prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> list[list[int]]:
    """Plain greedy decoding without speculation (and without the prefix cache)."""
    llm = LLM(nemotron_h_mtp()[0], enable_prefix_caching=False, **{**OPTIONS, "max_num_seqs": 8})
    outs = llm.generate(prompt_token_ids=[list(p) for p in prompts], sampling_params=greedy(max_tokens))
    return [o.token_ids for o in outs]


def spec_llm(method: str, k: int, rollback: str, **overrides: object) -> LLM:
    spec = {"method": method, "num_speculative_tokens": k, "rollback": rollback}
    return LLM(nemotron_h_mtp()[0], speculative_config=spec, **{**OPTIONS, **overrides})


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_equals_plain_decoding(method: str, k: int, rollback: str) -> None:
    prompts = random_prompts(PROMPT_LENS, VOCAB, seed=k)
    llm = spec_llm(method, k, rollback)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(28))
    assert [o.token_ids for o in outs] == reference(tuple(map(tuple, prompts)), 28)
    assert all(o.num_accepted_tokens <= o.num_draft_tokens for o in outs)
    llm.engine.pool.check()


def oracle_drafter(truth: dict[tuple[int, ...], list[int]], accept_rate: float, seed: int = 0):
    """Drafts that are the true greedy continuation, each corrupted with probability 1 - accept_rate."""
    rng = random.Random(seed)

    def draft(request) -> list[int]:
        full = truth[tuple(request.prompt_token_ids)]
        n = request.num_tokens
        return [t if rng.random() < accept_rate else (t + 1) % VOCAB for t in full[n : n + 4]]

    return draft


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("rate", [1.0, 0.5, 0.0])
def test_oracle_drafts_full_partial_and_zero_acceptance(method: str, rollback: str, rate: float) -> None:
    k, max_tokens = 3, 40
    prompts = random_prompts(PROMPT_LENS, VOCAB, seed=11)
    expected = reference(tuple(map(tuple, prompts)), max_tokens)
    truth = {tuple(p): p + e for p, e in zip(prompts, expected)}
    llm = spec_llm(method, k, rollback)
    llm.engine.spec.set_drafter(oracle_drafter(truth, rate))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens))
    assert [o.token_ids for o in outs] == expected
    metrics = llm.engine.spec.metrics
    if rate == 1.0:  # every draft accepted: K + 1 tokens per verify (the last steps are cut by max_tokens)
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens
        assert metrics.acceptance_length == k + 1
    elif rate == 0.0:
        assert metrics.num_accepted_tokens == 0 and metrics.acceptance_length == 1.0
    else:
        assert 1.0 < metrics.acceptance_length < k + 1
        assert metrics.accepted_per_position == sorted(metrics.accepted_per_position, reverse=True)
    llm.engine.pool.check()


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_multi_turn_hits_checkpoints_written_during_speculation(rollback: str) -> None:
    """Turn 2 = turn 1's prompt + answer + more: it resumes from a checkpoint that a verify step crossed."""
    k = 4
    first = random_prompts([11], VOCAB, seed=5)[0]
    expected = reference((tuple(first),), 45)[0]
    truth = {tuple(first): first + expected}
    llm = spec_llm("mtp", k, rollback)
    llm.engine.spec.set_drafter(oracle_drafter(truth, 1.0))
    out = llm.generate(prompt_token_ids=[first], sampling_params=greedy(45))[0]
    assert out.token_ids == expected
    llm.engine.spec.set_drafter(None)  # turn 2 drafts with the MTP module
    follow = first + out.token_ids + random_prompts([6], VOCAB, seed=6)[0]
    second = llm.generate(prompt_token_ids=[follow], sampling_params=greedy(20))[0]
    assert second.num_cached_tokens >= 48  # 11 + 45 tokens computed: checkpoints at 16, 32, 48
    assert second.token_ids == reference((tuple(follow),), 20)[0]
    llm.engine.pool.check()


def test_mtp_drafts_match_a_dense_reference() -> None:
    """The drafter's first draft after each step equals argmax lm_head(g) of the MTP math run densely."""
    model_dir, hf_model = nemotron_h_mtp()
    llm = spec_llm("mtp", 1, "intermediate")
    engine = llm.engine
    prompt = random_prompts([21], VOCAB, seed=9)[0]
    engine.add_request(prompt, greedy(12), "r")
    request = engine._requests["r"]
    mtp = engine.model.mtp
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if request.finished:
            break
        tokens = request.all_token_ids
        with torch.no_grad():
            out = hf_model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
            h = out.hidden_states[-1][0]  # final-normed hidden states h_0..h_{L-1}
            # slots 1..L-1: (x_q, h_{q-1}); the last slot predicts the first draft
            expected = int(engine.model.compute_logits(dense_mtp(engine.model, mtp, tokens, h))[-1].argmax())
        assert request.draft_tokens[0] == expected
        checked += 1
    assert checked >= 3


def dense_mtp(model, mtp, tokens: list[int], h: torch.Tensor) -> torch.Tensor:
    """g for slots 1..L-1 by plain torch: causal attention over the slots, no positions."""
    x = model.embeddings(torch.tensor(tokens[1:]))
    first = mtp.layers[0]
    u = first.eh_proj(torch.cat([first.enorm(x), first.hnorm(h[:-1])], dim=-1))
    for layer in mtp.layers:
        normed = layer.norm(u)
        if layer.kind == "attention":
            attn = layer.mixer
            cfg = attn.config
            n = normed.shape[0]
            q = attn.q_proj(normed).view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1)
            k = attn.k_proj(normed).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            v = attn.v_proj(normed).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            rep = cfg.num_heads // cfg.num_kv_heads
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True
            )
            u = u + attn.o_proj(o.transpose(0, 1).reshape(n, -1))
        else:
            u = u + layer.mixer(normed)
    return mtp.layers[-1].final_layernorm(u)


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_sampling_with_speculation_runs_and_is_seeded(rollback: str) -> None:
    prompts = random_prompts([7, 19], VOCAB, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, top_p=0.95, seed=7, ignore_eos=True)
    runs = [spec_llm("mtp", 3, rollback).generate(prompt_token_ids=prompts, sampling_params=params) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 16 and all(0 <= t < VOCAB for t in o.token_ids) for o in runs[0])


@pytest.mark.parametrize("stop_at", [1, 9, 16, 17])
def test_stop_token_inside_accepted_drafts_cuts_the_output(stop_at: int) -> None:
    """A stop inside the accepted drafts: only the tokens up to it count as computed (several stop
    positions, so some cut a verify whose accepted tokens cross a KV page / cache block boundary)."""
    prompts = random_prompts([13], VOCAB, seed=4)
    expected = reference((tuple(prompts[0]),), 30)[0]
    stop = expected[stop_at]
    truth = {tuple(prompts[0]): prompts[0] + expected}
    llm = spec_llm("ngram", 4, "replay")
    llm.engine.spec.set_drafter(oracle_drafter(truth, 1.0))
    out = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=30, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert out.token_ids == expected[: expected.index(stop) + 1] and out.finish_reason == "stop"
    llm.engine.pool.check()


def test_ngram_proposals() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([5, 6, 7], 2, 1, 3) == []
    assert propose_ngram([9, 8, 9], 2, 2, 3) == []  # only a 1-token suffix recurs


def test_incremental_ngram_index_equals_the_scan() -> None:
    """The per-request index gives the scan's proposals on sequences that grow by 1..3 tokens a step."""
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.randint(1, 3)
        hi, vocab = rng.randint(lo, 5), rng.randint(2, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        index = NgramIndex(lo, hi)
        for _ in range(30):
            k = rng.randint(1, 4)
            assert index.propose(tokens, k) == propose_ngram(tokens, k, lo, hi)
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 2, "rollback": "copy"}, "rollback"),
        ({"method": "mtp"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 2, "typo": 1}, "unknown"),
        ("mtp", "dict"),
    ],
)
def test_bad_speculative_config_is_a_value_error(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)  # type: ignore[arg-type]


def test_mtp_needs_an_mtp_checkpoint() -> None:
    from checkpoints import nemotron_h

    with pytest.raises(ValueError, match="MTP module"):
        LLM(nemotron_h("M*-M")[0], speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **OPTIONS)


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_ngram_on_a_pure_mamba2_model(rollback: str) -> None:
    """No attention at all (no KV pages): verify, rollback and checkpoints still agree with plain decoding."""
    from checkpoints import mamba2

    model_dir, _ = mamba2()
    prompts = [p + p for p in random_prompts([5, 20, 33], VOCAB, seed=1)]  # repeats give the n-gram drafts
    params = greedy(30)
    expected = LLM(model_dir, state_block=16).generate(prompt_token_ids=prompts, sampling_params=params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(model_dir, state_block=16, speculative_config=spec)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert llm.engine.spec.metrics.num_draft_tokens > 0
    llm.engine.pool.check()
