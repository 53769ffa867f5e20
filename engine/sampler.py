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


def target_probs(logits: torch.Tensor, param: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: logits [..., V] -> probs [..., V] fp32 on the CPU
    (temperature, then top-k / top-p per row)."""
    rows = logits.float().cpu().reshape(-1, logits.shape[-1]) / param.temperature
    filtered = torch.stack([_filter_top_k_top_p(row, param.top_k, param.top_p) for row in rows])
    return torch.softmax(filtered, dim=-1).reshape(logits.shape)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits: [B, V] fp32, one row per request -> one token id per row."""
    greedy_tokens = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.greedy:
            tokens.append(int(greedy_tokens[row]))
            continue
        probs = target_probs(logits[row], param)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens
