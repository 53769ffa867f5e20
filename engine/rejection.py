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

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.sampler import draw, target_probs


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
    """Rejection sampling for one request on the logits' device; draws from the request's own generator."""
    n = len(drafts)
    probs = target_probs(target_logits[: n + 1], params)  # [n + 1, V]
    if n == 0:
        return Acceptance([int(draw(probs[:1], [generator])[0])], 0)
    index = torch.tensor(drafts, device=probs.device)
    rows = torch.arange(n, device=probs.device)
    p_draft = probs[rows, index]  # [n]
    if draft_probs is None:  # one-hot q: keep with probability p(d)
        q = None
        ratio = p_draft
    else:
        q = draft_probs.to(device=probs.device, dtype=torch.float32)
        q_draft = q[rows, index]
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.zeros_like(p_draft))
    uniforms = torch.rand(n, generator=generator)
    kept = uniforms.to(probs.device) < ratio
    accepted = n if bool(kept.all()) else int(torch.argmin(kept.int()))  # the first rejection
    if accepted == n:
        bonus = int(draw(probs[n : n + 1], [generator])[0])
        return Acceptance(list(drafts) + [bonus], n)
    p = probs[accepted]
    if q is None:
        residual = p.clone()
        residual[drafts[accepted]] = 0.0
    else:
        residual = (p - q[accepted]).clamp(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q on the support: a rejection has probability 0; fall back to p
        residual = p
    replacement = int(draw(residual[None], [generator])[0])
    return Acceptance(drafts[:accepted] + [replacement], accepted)
