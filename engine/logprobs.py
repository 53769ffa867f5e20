"""Log-probabilities of tokens, computed on the logits' device, one host copy per call.

Which distribution: the one the token is sampled from ("processed" logprobs, vLLM's
`logprobs_mode="processed_logprobs"`; vLLM's default reports raw model logprobs instead). For a sampling
request that is log of `sampler.params_probs`: logits / temperature, top-k and top-p applied (tokens they
remove have logprob -inf, reported as `LOGPROB_FLOOR`); for a greedy request (temperature 0) it is
log_softmax of the raw logits. Prompt logprobs (`echo`) have no sampling step and are always the raw
log_softmax, as scoring tools (lm-eval loglikelihood) expect. Speculative verify rows use the same function on
the verify logits, so a request reports the same logprobs with and without speculation.
"""

from __future__ import annotations

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.sampler import params_probs

LOGPROB_FLOOR = -9999.0  # -inf (a token top-k / top-p removed) is not valid JSON; vLLM's server uses the same floor


def processed_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] logits, one SamplingParams per row -> [R, V] fp32 log-probabilities of the sampled-from distribution."""
    out = torch.log_softmax(logits.float(), dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        out[index] = torch.log(params_probs(logits[index], [params[i] for i in rows]))
    return out


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


def sampled_logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]) -> list[TokenLogprob]:
    """Logprobs of tokens sampled from `logits` [R, V] (row r with params[r])."""
    return gather_logprobs(processed_logprobs(logits, params), token_ids, [p.logprobs or 0 for p in params])
