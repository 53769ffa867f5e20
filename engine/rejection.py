"""Acceptance of drafted tokens against the target's logits from one verify pass.

Greedy requests keep the longest prefix of drafts equal to the target's argmax, then take the target's
token at the first mismatch (or after the last draft: the bonus token). Sampling requests use rejection
sampling (Leviathan et al. 2023): draft d_i drawn from q is kept with probability min(1, p(d_i) / q(d_i));
at the first rejection the token is drawn from normalize(max(p - q, 0)); when all are kept a bonus token is
drawn from p at the next position. The emitted tokens are then distributed exactly as the target's own
samples. A draft without a distribution (n-gram) has q = one-hot(d_i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.engine.sampler import target_probs
from hybridserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Acceptance:
    tokens: list[int]  # accepted drafts followed by one token from the target (length num_accepted + 1)
    num_accepted: int


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> Acceptance:
    """target_argmax: the target's argmax at the T verify positions (T >= len(drafts) + 1)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return Acceptance(drafts[:accepted] + [target_argmax[accepted]], accepted)


def accept_sampled(
    target_logits: torch.Tensor,  # [T, V] logits at the verify positions (T >= len(drafts) + 1)
    drafts: list[int],
    draft_probs: torch.Tensor | None,  # [len(drafts), V] q of each draft, None for one-hot drafts
    params: SamplingParams,
    generator: torch.Generator,
) -> Acceptance:
    """Rejection sampling for one request; draws from the request's own generator."""
    probs = target_probs(target_logits[: len(drafts) + 1], params)  # [n + 1, V]
    for i, token in enumerate(drafts):
        p = probs[i]
        if draft_probs is None:
            q_token = 1.0
            residual = p.clone()
            residual[token] = 0.0
        else:
            q = draft_probs[i].float().cpu()
            q_token = float(q[token])
            residual = (p - q).clamp(min=0.0)
        ratio = float(p[token]) / q_token if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator)) < ratio:
            continue
        total = float(residual.sum())
        if total <= 0.0:  # p == q on the support: any rejection is measure-zero; fall back to p
            residual, total = p, float(p.sum())
        replacement = int(torch.multinomial(residual / total, 1, generator=generator))
        return Acceptance(drafts[:i] + [replacement], i)
    bonus = int(torch.multinomial(probs[len(drafts)], 1, generator=generator))
    return Acceptance(list(drafts) + [bonus], len(drafts))
