"""Metadata of one forward pass over packed tokens of many sequences (the model runner builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """Sequences [0:num_decode] have `decode_len` new tokens each (1, or 1 + K drafts when speculating) and
    state from earlier steps; the rest are prefill chunks (fresh, or resumed after `context_lens` cached
    tokens). All tensors live on the device."""

    num_decode: int
    query_lens: tuple[int, ...]  # new tokens per sequence (host copy)
    cu_seqlens: torch.Tensor  # [S + 1] int64 offsets of each sequence's new tokens
    context_lens: torch.Tensor  # [S] int64 tokens computed before this step
    kv_lens: torch.Tensor  # [S] int64 context + new tokens
    state_slots: torch.Tensor  # [S] int64 Mamba state slot of each sequence
    block_tables: torch.Tensor  # [S, max_pages] int64 KV pages of each sequence
    slot_mapping: torch.Tensor  # [N] int64 KV slot (page * page_size + offset) of each new token
    # Prefix-cache checkpoints. The prefill sequences cross `num_checkpoint_boundaries` multiples of
    # state_block in (context, context + new] (sequence then position order); the Mamba kernels write the conv
    # window and SSM state at boundary k straight into state row boundary_rows[k] (-1: not kept).
    state_block: int | None = None
    num_checkpoint_boundaries: int = 0
    boundary_rows: torch.Tensor | None = None  # [num_checkpoint_boundaries] int64 row per boundary, -1 = skip
    # (None when no boundary is kept)
    # Speculative verify of the decode rows: "intermediate" keeps every token's SSM state in
    # `intermediate_states` (layer -> [num_decode, decode_len, H, P, N]) and leaves the slot untouched;
    # "replay" folds `num_replay` tokens of the previous verify into the slot first (kernels/replay_state.py).
    decode_len: int = 1
    spec_rollback: str | None = None
    num_replay: torch.Tensor | None = None  # [num_decode] int32
    intermediate_states: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def prefill_cu_seqlens(self) -> torch.Tensor:
        """Offsets of the prefill sequences' tokens, starting at 0: [S - num_decode + 1]."""
        cu = self.cu_seqlens[self.num_decode :]
        return cu - cu[0]
