"""Metadata of one forward pass over packed tokens of many sequences (the model runner builds it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridserve.kernels.causal_conv1d import ConvVarlenMeta, conv_varlen_metadata
from hybridserve.kernels.paged_attention import DECODE_MAX_QUERY, QueryBlocks, query_blocks
from hybridserve.kernels.ssd_scan_meta import ChunkMeta, chunk_metadata_from_lists


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
    # "replay" folds `num_replay` tokens of the previous verify into the slot first (kernels/replay_state_update.py).
    decode_len: int = 1
    spec_rollback: str | None = None
    num_replay: torch.Tensor | None = None  # [num_decode] int32
    intermediate_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # host copy of context_lens: the kernels' per-batch index lists are built from it without a device sync
    context_lens_host: tuple[int, ...] | None = None
    # called with a layer's index right after its mixer was queued (its KV / state writes for this step are
    # then queued too): a prefill worker stages a prompt's final state layer by layer in the forward of its
    # last chunk. None (every other step, CUDA-graph decode steps included): nothing is called
    layer_done: Callable[[int], None] | None = field(default=None, compare=False)
    # per-batch metadata shared by every layer of the forward, built on first use (see the methods below)
    _derived: dict[tuple, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def prefill_cu_seqlens(self) -> torch.Tensor:
        """Offsets of the prefill sequences' tokens, starting at 0: [S - num_decode + 1] (built once per batch)."""
        key = ("prefill_cu",)
        if key not in self._derived:
            cu = self.cu_seqlens[self.num_decode :]
            self._derived[key] = cu - cu[0]
        return self._derived[key]  # type: ignore[return-value]

    def decode_half(self) -> ForwardBatch:
        """The decode rows of a mixed batch alone (one token each, or T verify tokens with this batch's rollback;
        views of this batch's tensors), so they can replay a CUDA graph while only the prefill runs eagerly
        (`prefill_half`). Their per-token SSM states land in this batch's `intermediate_states` (the same dict)."""
        nd = self._check_splittable()
        rows = nd * self.decode_len
        return ForwardBatch(
            num_decode=nd, query_lens=self.query_lens[:nd], cu_seqlens=self.cu_seqlens[: nd + 1],
            context_lens=self.context_lens[:nd], kv_lens=self.kv_lens[:nd], state_slots=self.state_slots[:nd],
            block_tables=self.block_tables[:nd], slot_mapping=self.slot_mapping[:rows],
            context_lens_host=None if self.context_lens_host is None else self.context_lens_host[:nd],
            decode_len=self.decode_len, spec_rollback=self.spec_rollback, num_replay=self.num_replay,
            intermediate_states=self.intermediate_states,
        )

    def prefill_half(self) -> ForwardBatch:
        """The prefill rows of a mixed batch alone. Its tensors are fresh copies, not views at an offset: Triton
        specializes on pointer alignment, and a view at an odd row would launch kernel variants the warm-up never
        compiled."""
        nd = self._check_splittable()
        rows = nd * self.decode_len
        return ForwardBatch(
            num_decode=0, query_lens=self.query_lens[nd:], cu_seqlens=self.cu_seqlens[nd:] - rows,
            context_lens=self.context_lens[nd:].clone(), kv_lens=self.kv_lens[nd:].clone(),
            state_slots=self.state_slots[nd:].clone(), block_tables=self.block_tables[nd:].clone(),
            slot_mapping=self.slot_mapping[rows:].clone(), state_block=self.state_block,
            num_checkpoint_boundaries=self.num_checkpoint_boundaries, boundary_rows=self.boundary_rows,
            context_lens_host=None if self.context_lens_host is None else self.context_lens_host[nd:],
            layer_done=self.layer_done,
        )

    def _check_splittable(self) -> int:
        nd = self.num_decode
        if not 0 < nd < self.num_seqs:
            raise ValueError(f"a batch splits into decode rows and prefill rows, got num_decode={nd} of "
                             f"{self.num_seqs} sequences")
        return nd

    # ---- metadata every layer of one forward shares: built once, on the first layer that needs it ----------
    def _prefill_starts(self) -> list[int]:
        if self.context_lens_host is not None:
            return list(self.context_lens_host[self.num_decode :])
        return [int(n) for n in self.context_lens[self.num_decode :].tolist()]  # one sync, then memoized

    def prefill_chunk_meta(self, chunk_size: int, state_block: int | None) -> ChunkMeta:
        """The SSD scan's logical chunks of the prefill sequences."""
        key = ("chunks", chunk_size, state_block)
        if key not in self._derived:
            lens = self.query_lens[self.num_decode :]
            bounds = [0]
            for n in lens:
                bounds.append(bounds[-1] + n)
            self._derived[key] = chunk_metadata_from_lists(
                bounds, self._prefill_starts(), chunk_size, state_block, self.cu_seqlens.device
            )
        return self._derived[key]  # type: ignore[return-value]

    def prefill_conv_meta(self, state_block: int | None) -> ConvVarlenMeta:
        """The varlen conv's token / window indices of the prefill sequences."""
        key = ("conv", state_block)
        if key not in self._derived:
            self._derived[key] = conv_varlen_metadata(
                list(self.query_lens[self.num_decode :]), self._prefill_starts(), state_block, self.cu_seqlens.device
            )
        return self._derived[key]  # type: ignore[return-value]

    def prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(state slots [S - num_decode], start positions [S - num_decode]) of the prefill sequences, as their own
        16-byte-aligned tensors: views at offset num_decode would be aligned or not with its parity, and Triton
        compiles a kernel variant per pointer alignment."""
        key = ("rows",)
        if key not in self._derived:
            nd = self.num_decode
            self._derived[key] = (self.state_slots[nd:].clone(), self.context_lens[nd:].clone())
        return self._derived[key]  # type: ignore[return-value]

    def prefill_init_rows(self) -> torch.Tensor:
        """[S - num_decode] the state slot each prefill sequence resumes from, -1 for a fresh one (the SSD scan's
        initial-state rows, built once per batch instead of in every layer)."""
        key = ("init_rows",)
        if key not in self._derived:
            slots, starts = self.prefill_rows()
            self._derived[key] = torch.where(starts > 0, slots, -1)
        return self._derived[key]  # type: ignore[return-value]

    def attention_blocks(self) -> QueryBlocks | None:
        """The prefill attention kernel's work list; None when every sequence takes the decode kernel (so a
        decode step, which CUDA graphs capture, never copies anything from the host)."""
        if max(self.query_lens, default=0) <= DECODE_MAX_QUERY:
            return None
        key = ("attention",)
        if key not in self._derived:
            self._derived[key] = query_blocks(self.query_lens, self.cu_seqlens.device)
        return self._derived[key]  # type: ignore[return-value]
