"""`StepOutput`: what one engine step produced, in its own module because the scheduler reads it and the model
runner writes it (neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.models.forward_batch import ForwardBatch


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, vLLM v1's ModelRunnerOutput shape: per scheduled row (decodes first, then
    prefill chunks) the list of its new token ids: one sampled token for a plain decode or a prefill chunk
    that finished the prompt, none for a chunk short of it, and after speculative acceptance the accepted
    drafts plus one for a verify row (`num_verify_rows` rows, filled by `SpecDecoder.accept`). Beside them
    the final hidden states of every computed token, the batch that placed them and the verify logits."""

    hidden: torch.Tensor  # [N, hidden]
    batch: ForwardBatch
    new_token_ids: list[list[int]]  # per scheduled row
    verify_logits: torch.Tensor | None = None  # [num_decode, T, vocab] fp32
    num_verify_rows: int = 0  # the first rows are verify rows: they computed exactly the tokens they keep
    logprobs: list[list[TokenLogprob]] | None = None  # per row, one per new token of requests that asked
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] | None = None  # row -> (first prompt position, ...)
