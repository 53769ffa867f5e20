"""Log-probabilities of tokens, computed on the logits' device, one host copy per call.

Which distribution: the model's own, log_softmax of the raw logits, before any logits processor (repetition
penalty, bad words, grammar masks), temperature, top-k or top-p; what vLLM reports by default
(`logprobs_mode="raw_logprobs"`) and what the OpenAI API documents. Prompt logprobs (`echo`) are the same, as
scoring tools (lm-eval loglikelihood) expect. Speculative verify rows use the same function on the raw verify
logits, so a request reports the same logprobs with and without speculation.
"""

from __future__ import annotations

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.common.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0  # -inf (a token top-k / top-p removed) is not valid JSON; vLLM's server uses the same floor


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logprobs [R, V], the token of each row and how many top alternatives it wants -> one TokenLogprob per row
    (rank 1 = the most likely token)."""
    if not token_ids:
        return []
    device = logprobs.device
    tokens = torch.tensor(token_ids, device=device)[:, None]  # [R, 1]
    chosen = logprobs.gather(1, tokens)  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [R]
    k = min(max(num_top), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], tokens[:, :0])
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    values_l, ids_l = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token, max(value, LOGPROB_FLOOR), rank,
                     tuple((i, max(v, LOGPROB_FLOOR)) for i, v in zip(ids_l[r][:n], values_l[r][:n])))
        for r, (token, value, rank, n) in enumerate(zip(token_ids, chosen_l, ranks_l, num_top))
    ]


def sampled_logprobs(raw_logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]) -> list[TokenLogprob]:
    """Logprobs of the tokens sampled at `raw_logits` [R, V] (the model's logits before any processing; row r
    with params[r], which says how many top alternatives it wants)."""
    return gather_logprobs(torch.log_softmax(raw_logits.float(), dim=-1), token_ids, [p.logprobs or 0 for p in params])
