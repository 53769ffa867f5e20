"""Speculative-decoding bookkeeping around the state cache: working memory and checkpoint hidden states."""

from __future__ import annotations

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.scheduler import ScheduledChunk
from hybridserve.engine.spec_config import SpeculativeConfig
from hybridserve.engine.step_output import StepOutput
from hybridserve.statepool.state_cache import StateCache


def spec_working_bytes(
    config: ModelConfig, spec: SpeculativeConfig | None, max_num_seqs: int, ssm_dtype: torch.dtype,
    dtype: torch.dtype,
) -> int:
    """Memory the verify pass needs besides the pools: with "intermediate" rollback one SSM state per verify
    token of every running request; with "replay" the previous step's inputs per slot (x, B, dt, cumsum)."""
    mamba = config.mamba
    if spec is None or mamba is None:
        return 0
    layers = len(config.layers_of("mamba"))
    tokens = spec.num_verify_tokens
    ssm_size = torch.empty((), dtype=ssm_dtype).element_size()
    size = torch.empty((), dtype=dtype).element_size()
    if spec.rollback == "intermediate":
        per_seq = tokens * mamba.num_heads * mamba.head_dim * mamba.state_size * ssm_size
    else:
        per_seq = tokens * (mamba.num_heads * mamba.head_dim * size + 2 * mamba.n_groups * mamba.state_size * size
                            + 4 * mamba.num_heads * 4)
    return per_seq * layers * max_num_seqs


def write_checkpoint_hidden(
    cache: StateCache, prefills: list[ScheduledChunk], checkpoint_slots: list[int], output: StepOutput,
    num_decode: int, state_block: int,
) -> None:
    """Give every prefill checkpoint the target hidden state of the token before its boundary (the MTP
    drafter's next slot needs it after a prefix-cache hit). Same boundary order as `plan_checkpoints`."""
    if not cache.hidden_states.shape[0] or not checkpoint_slots:
        return
    cu = output.batch.cu_seqlens.tolist()
    rows, sources = [], []
    boundary = 0
    for index, chunk in enumerate(prefills):
        start = chunk.request.num_computed_tokens
        first = (start // state_block + 1) * state_block
        for position in range(first, start + chunk.num_tokens + 1, state_block):
            slot = checkpoint_slots[boundary]
            boundary += 1
            if slot >= 0:
                rows.append(slot)
                sources.append(cu[num_decode + index] + position - 1 - start)
    if rows:
        device = cache.hidden_states.device
        cache.hidden_states[torch.tensor(rows, device=device)] = output.hidden[torch.tensor(sources, device=device)].to(
            cache.hidden_states.dtype
        )
