"""Per-request logits processing before sampling: `min_tokens` (EOS and stop tokens masked until then),
`logit_bias`, `repetition_penalty` (prompt and output tokens: positive logits divided, negative multiplied, as
HF / vLLM do), then `frequency_penalty` and `presence_penalty` (output tokens: count-scaled and flat, as
OpenAI defines them), then `no_repeat_ngram_size` (tokens that would complete an n-gram already present in
prompt + output are banned, as transformers' generation does). The processed logits are what the sampler,
greedy argmax, speculative acceptance and the reported logprobs all see; a verify position's output history
includes the drafts before it, so speculative decoding processes each token exactly as plain decoding would."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from hybridserve.common.sampling_params import SamplingParams


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or params.no_repeat_ngram_size)


def process_row(
    logits: torch.Tensor,  # [V] one position, modified in place (fp32)
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],  # tokens generated before this position
    eos_token_ids: Collection[int],
) -> None:
    device, vocab = logits.device, logits.shape[-1]
    if len(output) < params.min_tokens:
        banned = [t for t in (*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)) if t < vocab]
        if banned:
            logits[torch.tensor(banned, device=device)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        logits.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], device=device, dtype=logits.dtype))
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=device)
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), device=device), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.no_repeat_ngram_size:
        banned = repeated_ngram_ends([*prompt, *output], params.no_repeat_ngram_size)
        banned = [t for t in banned if t < vocab]
        if banned:
            logits[torch.tensor(banned, device=device)] = float("-inf")


def repeated_ngram_ends(tokens: Sequence[int], n: int) -> list[int]:
    """The tokens that would end an n-gram already in `tokens` if appended: every token that followed an earlier
    occurrence of the last n-1 tokens. Hand-written (one pass; no library offers it for a token list)."""
    if n == 1:
        return sorted(set(tokens))
    if len(tokens) < n:
        return []
    key = list(tokens[len(tokens) - n + 1:])
    first = key[0]
    found = set()
    for i in range(len(tokens) - n + 1):  # windows tokens[i : i + n - 1] that end before the last token
        if tokens[i] == first and list(tokens[i:i + n - 1]) == key:
            found.add(tokens[i + n - 1])
    return sorted(found)


def process_logits(
    logits: torch.Tensor,  # [R, V]
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],  # per row (prompt, output before this position)
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """The logits with each row's processors applied (fp32 copy when any row needs one, else unchanged)."""
    rows = [i for i, p in enumerate(params) if needs_processing(p)]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        prompt, output = histories[i]
        process_row(out[i], params[i], prompt, output, eos_token_ids)
    return out
