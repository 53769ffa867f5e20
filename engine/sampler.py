"""Token sampling: greedy, or temperature + top-k + top-p with each request's own generator, so a
request's samples do not depend on what else is in the batch."""

from __future__ import annotations

import torch

from hybridserve.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] fp32 -> logits with excluded tokens at -inf."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits: [B, V] fp32, one row per request -> one token id per row."""
    greedy_tokens = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.greedy:
            tokens.append(int(greedy_tokens[row]))
            continue
        scaled = _filter_top_k_top_p(logits[row].float().cpu() / param.temperature, param.top_k, param.top_p)
        probs = torch.softmax(scaled, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens
