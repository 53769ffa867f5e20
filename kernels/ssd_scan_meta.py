"""Logical-chunk metadata for the varlen SSD scan: where each chunk starts, how long it is, which sequence
owns it and whether its end state is kept (an absolute multiple of state_block); and the *segments* (runs of
up to `segment_chunks` chunks of one sequence) the state walk runs in parallel before a short pass joins them.

Built on the host from cu_seqlens / start_positions; callers that launch many layers with the same batch build
it once (from host lists: no sync) and pass it to every scan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.kernels.host_index import pack_to_device

# one walk segment per sequence: the H100 sweep found no shape where splitting the walk paid for the join
# (bench/results/h100/kernels/ssd_sweep.json); callers may still pass segment_chunks
WHOLE_SEQUENCE = 1 << 30


@dataclass(frozen=True)
class ChunkMeta:
    """Device tensors (int32 unless noted) describing the logical chunks of one packed batch."""

    num_seqs: int
    num_chunks: int
    num_kept: int
    chunk_start: torch.Tensor  # [C] first token (packed index) of each chunk
    chunk_len: torch.Tensor  # [C] tokens in the chunk, 1..chunk_size
    seq_chunk_ptr: torch.Tensor  # [S + 1] chunks of sequence s are seq_chunk_ptr[s] .. seq_chunk_ptr[s+1]-1
    keep_idx: torch.Tensor  # [C] row in the kept-states output of the chunk's end state, -1 if not kept
    kept_seq: torch.Tensor  # [K] int64 sequence of each kept state
    kept_pos: torch.Tensor  # [K] int64 absolute token count at each kept chunk end
    num_segments: int
    segment_chunks: int
    seg_chunk_ptr: torch.Tensor  # [G + 1] chunks of segment j are seg_chunk_ptr[j] .. seg_chunk_ptr[j+1]-1
    seg_seq: torch.Tensor  # [G] sequence of each segment
    seg_first: torch.Tensor  # [G] 1 for a sequence's first segment (its walk starts from the initial state)
    seq_seg_ptr: torch.Tensor  # [S + 1] segments of sequence s
    chunk_seg: torch.Tensor  # [C] segment of the chunk, -1 in a first segment (no start-state correction)


def chunk_metadata(
    cu_seqlens: torch.Tensor,  # [S + 1]
    start_positions: torch.Tensor | None,  # [S] absolute position of each sequence's first token
    chunk_size: int,
    state_block: int | None,
    device: torch.device,
    segment_chunks: int = 0,
) -> ChunkMeta:
    """`chunk_metadata_from_lists` from device tensors (reads them back: one host sync per tensor)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    num_seqs = len(bounds) - 1
    starts = [0] * num_seqs if start_positions is None else [int(p) for p in start_positions.tolist()]
    return chunk_metadata_from_lists(bounds, starts, chunk_size, state_block, device, segment_chunks)


@dataclass(frozen=True)
class ChunkLists:
    """`ChunkMeta`'s index arrays on the host (what `chunk_metadata_from_lists` sends to the device)."""

    chunk_start: list[int]
    chunk_len: list[int]
    seq_chunk_ptr: list[int]
    keep_idx: list[int]
    kept_seq: list[int]
    kept_pos: list[int]
    seg_chunk_ptr: list[int]
    seg_seq: list[int]
    seg_first: list[int]
    seq_seg_ptr: list[int]
    chunk_seg: list[int]


def chunk_lists(
    bounds: list[int],  # [S + 1] cu_seqlens on the host
    starts: list[int],  # [S] absolute position of each sequence's first token
    chunk_size: int,
    state_block: int | None,
    segment_chunks: int = 0,
) -> ChunkLists:
    """Split every sequence at absolute multiples of chunk_size; keep ends at multiples of state_block; group
    each sequence's chunks into segments of segment_chunks (0: one segment per sequence)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    segment_chunks = segment_chunks or WHOLE_SEQUENCE
    if segment_chunks < 0:
        raise ValueError(f"segment_chunks must be positive (0: one segment per sequence), got {segment_chunks}")
    keep_every = chunk_size if state_block is None else state_block
    if keep_every % chunk_size != 0:
        raise ValueError(f"state_block ({state_block}) must be a multiple of chunk_size ({chunk_size})")
    num_seqs = len(bounds) - 1
    if len(starts) != num_seqs:
        raise ValueError(f"start_positions has {len(starts)} entries for {num_seqs} sequences")
    chunk_start: list[int] = []
    chunk_len: list[int] = []
    keep_idx: list[int] = []
    kept_seq: list[int] = []
    kept_pos: list[int] = []
    seq_ptr = [0]
    for seq in range(num_seqs):
        token, end, pos = bounds[seq], bounds[seq + 1], starts[seq]
        if end < token:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
        while token < end:
            length = min(chunk_size - pos % chunk_size, end - token)
            chunk_start.append(token)
            chunk_len.append(length)
            token += length
            pos += length
            if pos % keep_every == 0:
                keep_idx.append(len(kept_seq))
                kept_seq.append(seq)
                kept_pos.append(pos)
            else:
                keep_idx.append(-1)
        seq_ptr.append(len(chunk_start))
    seg_seq: list[int]
    seg_first: list[int]
    chunk_seg: list[int]
    seg_ptr, seg_seq, seg_first, seq_seg_ptr, chunk_seg = [0], [], [], [0], []
    for seq in range(num_seqs):
        for first in range(seq_ptr[seq], seq_ptr[seq + 1], segment_chunks):
            last = min(first + segment_chunks, seq_ptr[seq + 1])
            is_first = first == seq_ptr[seq]
            chunk_seg.extend([-1 if is_first else len(seg_seq)] * (last - first))
            seg_ptr.append(last)
            seg_seq.append(seq)
            seg_first.append(int(is_first))
        seq_seg_ptr.append(len(seg_seq))
    return ChunkLists(chunk_start, chunk_len, seq_ptr, keep_idx, kept_seq, kept_pos, seg_ptr, seg_seq, seg_first,
                      seq_seg_ptr, chunk_seg)


# ChunkLists' int32 arrays, in the order `chunk_metadata_from_lists` packs them
INT32_FIELDS = ("chunk_start", "chunk_len", "seq_chunk_ptr", "keep_idx", "seg_chunk_ptr", "seg_seq", "seg_first",
                "seq_seg_ptr", "chunk_seg")


def chunk_metadata_from_lists(
    bounds: list[int],  # [S + 1] cu_seqlens on the host
    starts: list[int],  # [S] absolute position of each sequence's first token
    chunk_size: int,
    state_block: int | None,
    device: torch.device,
    segment_chunks: int = 0,
) -> ChunkMeta:
    """`chunk_lists` on the device. No host sync: the index arrays travel to the device in one copy (a forward
    builds this once and hands it to every Mamba layer)."""
    lists = chunk_lists(bounds, starts, chunk_size, state_block, segment_chunks)
    int32_fields = {name: getattr(lists, name) for name in INT32_FIELDS}
    # one host -> device copy for all of them, each view 16-byte aligned (an empty list still gets one element:
    # kernels take a pointer)
    on_device = pack_to_device([v if v else [0] for v in int32_fields.values()], torch.int32, device)
    kept_seq_t, kept_pos_t = pack_to_device([lists.kept_seq, lists.kept_pos], torch.int64, device)
    tensors = dict(zip(int32_fields, on_device))
    return ChunkMeta(
        num_seqs=len(bounds) - 1,
        num_chunks=len(lists.chunk_start),
        num_kept=len(lists.kept_seq),
        kept_seq=kept_seq_t,
        kept_pos=kept_pos_t,
        num_segments=len(lists.seg_seq),
        segment_chunks=segment_chunks or WHOLE_SEQUENCE,
        **tensors,
    )
