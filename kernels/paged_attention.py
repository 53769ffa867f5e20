"""Causal GQA attention over a paged KV cache (prefill on top of a cached prefix, decode, verify).

Pages: k_pages / v_pages [num_pages, page_size, Hkv, Dh]. Token t of a sequence lives in page
block_table[t // page_size] at offset t % page_size. Query i of a sequence with q_len new tokens and
kv_len tokens in total sits at absolute position kv_len - q_len + i and sees keys 0..that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.kernels.host_index import pack_to_device

PREFILL_BLOCK_M = 64  # query rows per program of the Triton prefill kernel
DECODE_MAX_QUERY = 16  # sequences with at most this many new tokens take the decode / verify kernel
FP8_MAX = 448.0  # largest finite float8_e4m3fn: fp8 KV writes saturate here (a plain cast would give NaN)


@dataclass(frozen=True)
class QueryBlocks:
    """The prefill kernel's work list: one (sequence, first query row) per block of PREFILL_BLOCK_M queries.
    A forward builds it once from the host's query lengths (`query_blocks`) for all its attention layers."""

    query_lens: tuple[int, ...]  # [S] new tokens per sequence (what it was built from)
    seq: torch.Tensor  # [num_blocks] int32
    row: torch.Tensor  # [num_blocks] int32


def query_block_lists(query_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(sequence, first query row) of each block of PREFILL_BLOCK_M queries, on the host."""
    seqs: list[int] = []
    rows: list[int] = []
    for seq, length in enumerate(query_lens):
        for row in range(0, length, PREFILL_BLOCK_M):
            seqs.append(seq)
            rows.append(row)
    return seqs, rows


def query_blocks(query_lens: Sequence[int], device: torch.device) -> QueryBlocks:
    """`QueryBlocks` for these per-sequence query lengths (one host -> device copy, no sync)."""
    seqs, rows = query_block_lists(query_lens)
    seq_t, row_t = pack_to_device([seqs, rows], torch.int32, device)
    return QueryBlocks(tuple(query_lens), seq_t, row_t)


def write_kv_pages(
    key: torch.Tensor,  # [N, Hkv, Dh]
    value: torch.Tensor,  # [N, Hkv, Dh]
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh]
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] page * page_size + offset; -1 = padded token, skipped
    k_scale: float = 1.0,  # fp8 pages hold key / k_scale (and value / v_scale); 1.0 for half-precision pages
    v_scale: float = 1.0,
) -> None:
    """Scatter new keys / values into their page slots (works on strided per-layer views too); fp8 pages get
    the scaled values, saturated to the fp8 range."""
    page_size = k_pages.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    pages, offsets = slots // page_size, slots % page_size
    k_pages[pages, offsets] = to_page_dtype(key[valid], k_pages.dtype, k_scale)
    v_pages[pages, offsets] = to_page_dtype(value[valid], v_pages.dtype, v_scale)


def to_page_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the KV pages store it: x / scale, saturated to +-FP8_MAX, for fp8 pages; a plain cast otherwise."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)  # as the Triton write kernel
    return x.to(dtype)


def gather_kv(
    pages: torch.Tensor, block_table: torch.Tensor, kv_len: int  # block_table: [max_pages]
) -> torch.Tensor:
    """The first kv_len tokens of one sequence from its pages: [kv_len, Hkv, Dh]."""
    page_size = pages.shape[1]
    num_pages = (kv_len + page_size - 1) // page_size
    return pages[block_table[:num_pages].long()].reshape(-1, *pages.shape[2:])[:kv_len]


def paged_attention_ref(
    q: torch.Tensor,  # [N, Hq, Dh] packed queries
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh]
    v_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S + 1]
    kv_lens: torch.Tensor,  # [S] tokens in the cache per sequence, the new ones included
    block_tables: torch.Tensor,  # [S, max_pages]
    scale: float,
    max_query_len: int | None = None,  # launch hint for the Triton kernel; the reference needs none
    kv_start: int = 0,  # keys before this position are masked (the MTP drafter's slot 0); a query that
    # sees no key at all gets zeros
    blocks: QueryBlocks | None = None,  # the Triton prefill kernel's work list; the reference needs none
    k_scale: float = 1.0,  # pages hold key / k_scale, value / v_scale (fp8 KV; 1.0 otherwise)
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Reference attention in fp32 (fp8 pages dequantized); returns [N, Hq, Dh] in q's dtype."""
    num_q_heads = q.shape[1]
    num_kv_heads = k_pages.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    for seq in range(len(lens)):
        begin, end = bounds[seq], bounds[seq + 1]
        q_len, kv_len = end - begin, int(lens[seq])
        if q_len == 0:
            continue
        keys = gather_kv(k_pages, block_tables[seq], kv_len).float() * k_scale  # [kv_len, Hkv, Dh]
        values = gather_kv(v_pages, block_tables[seq], kv_len).float() * v_scale
        keys = keys.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), keys) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        hidden_keys = (k_pos > q_pos) | (k_pos < kv_start)
        scores = scores.masked_fill(hidden_keys, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)
