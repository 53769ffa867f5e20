"""Rejection sampling keeps the target distribution: chi-square of many seeded samples against p, for a
draft distribution that is good, bad, identical to the target, and one-hot (n-gram)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.rejection import accept_greedy, accept_sampled
from hybridserve.engine.sampler import target_probs

VOCAB = 8
SAMPLES = 6000
CHI2_CRITICAL_DF7 = 24.32  # chi-square 0.999 quantile, 7 degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draft_distribution(kind: str, p: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    if kind == "identical":
        return p.clone()
    if kind == "good":
        return torch.softmax(torch.log(p) + 0.3 * torch.randn(p.shape, generator=generator), dim=-1)
    if kind == "bad":
        return torch.softmax(3.0 * torch.randn(p.shape, generator=generator), dim=-1)
    return None  # one-hot drafts


@pytest.mark.parametrize("kind", ["good", "bad", "identical", "one-hot"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)])
def test_first_and_second_tokens_follow_the_target(kind: str, params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5  # T = 3 verify positions (K = 2)
    p = target_probs(logits, params)
    q = draft_distribution(kind, p[:2], generator)
    first = torch.zeros(VOCAB)
    second_after = {}  # emitted first token -> counts of the second emitted token
    sampler = torch.Generator().manual_seed(2)
    fixed_drafts = [int(p[0].argmax()), int(p[1].argmax())]
    for _ in range(SAMPLES):
        if q is None:
            drafts, draft_probs = fixed_drafts, None
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=sampler)) for i in range(2)]
            draft_probs = q
        result = accept_sampled(logits, drafts, draft_probs, params, sampler)
        assert 0 <= result.num_accepted <= 2 and len(result.tokens) == result.num_accepted + 1
        first[result.tokens[0]] += 1
        if len(result.tokens) > 1:
            second_after.setdefault(result.tokens[0], torch.zeros(VOCAB))[result.tokens[1]] += 1
    assert chi_square(first, p[0]) < CHI2_CRITICAL_DF7
    # the target's second token is independent of the first here (fixed logits): given a kept first draft,
    # the second emitted token must follow p[1]
    token, counts = max(second_after.items(), key=lambda item: item[1].sum())
    if counts.sum() > 800:
        assert chi_square(counts, p[1]) < CHI2_CRITICAL_DF7


def test_greedy_acceptance_edges() -> None:
    assert accept_greedy([5, 6, 7], [5, 6]).tokens == [5, 6, 7]  # all accepted + bonus
    assert accept_greedy([5, 6, 7], [4, 6]).tokens == [5]  # first rejected: the target's token
    assert accept_greedy([5, 6, 7], []).tokens == [5]  # no drafts: a plain decode step


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=5, top_p=0.8)])
def test_batched_sampler_follows_the_processed_distribution(params: SamplingParams) -> None:
    """`sample` (Gumbel-max rows for plain temperature, inverse-CDF draws for top-k / top-p; each row's randomness
    from its request's generator) against the processed distribution; tokens filtered out by top-k / top-p never
    come out."""
    from hybridserve.engine.sampler import sample

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    p = target_probs(logits, params)[0]
    generator = torch.Generator().manual_seed(9)
    counts = torch.zeros(VOCAB)
    rows = 500
    for _ in range(SAMPLES // rows):
        for token in sample(logits.expand(rows, -1), [params] * rows, [generator] * rows):
            counts[token] += 1
    assert chi_square(counts, p) < CHI2_CRITICAL_DF7
