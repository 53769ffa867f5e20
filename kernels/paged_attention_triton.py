"""Triton causal GQA attention over the paged KV cache (prefill on a cached prefix, decode, verify).

Prefill (some sequence has more than DECODE_MAX_QUERY new tokens): one program per (block of BLOCK_M query
tokens of one sequence, query head), online softmax over key tiles of BLOCK_N tokens gathered page by page
through the block table, stopping at the block's last visible key.
Decode / verify (every sequence has <= DECODE_MAX_QUERY new tokens): one program per (sequence, KV head, KV
split); the query heads of the KV head x the query tokens are the rows of one tl.dot, so each K/V tile is read
once per KV head, and at small batch the keys are split across programs (flash-decoding) whose fp32 partial
results a small kernel combines. Pages are read through their strides (per-layer views are strided).
The KV write, the decode kernel and the combine launch under PDL (`triton_utils.pdl_enabled`): each one's
programs are resident and waiting at `pdl_gate` while the kernel before finishes (with the one-tile splits of
MIN_SPLIT_KEYS: the 30B-A3B attention layer at batch 1 23.5 -> 17.3 us, bench/results/h200/decode_step/).
Reference and contract: `hybridserve.kernels.paged_attention.paged_attention_ref`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.paged_attention import DECODE_MAX_QUERY, PREFILL_BLOCK_M, QueryBlocks, query_blocks
from hybridserve.kernels.triton_utils import check_same_device, interpreting, next_pow2, pdl_gate, pdl_launch

DECODE_BLOCK_N = 64  # keys per tile of the decode kernel
# a KV split covers at least one decode tile: at batch 1 the programs are latency-bound, so at 512 keys of context 9
# one-tile splits beat 5 two-tile ones (30B-A3B step: paged decode 8.8 -> 6.0 us per layer, combine +0.4;
# bench/results/h200/decode_step/)
MIN_SPLIT_KEYS = DECODE_BLOCK_N
MAX_SPLITS = 64
_INTERPRETER_SMS = 4  # SM count assumed under the interpreter / off CUDA (keeps split choice deterministic)


@triton.jit
def _online_softmax_step(s, v, offs_n, q_pos, kv_start, mask_n, m_i, l_i, acc):
    """One key tile of causal online softmax (base 2): mask the scores s [M, N], fold p @ v [N, D] into acc."""
    visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] >= kv_start) & mask_n[None, :]
    s = tl.where(visible, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@lean_launch
@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, tables_ptr, block_seq_ptr, block_row_ptr,
    scale, v_scale, page_size, heads_per_kv, Dh, kv_start,
    q_n, q_h, q_d, k_p, k_o, k_h, k_d, v_p, v_o, v_h, v_d, o_n, o_h, o_d, t_s, t_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // heads_per_kv
    seq = tl.load(block_seq_ptr + blk).to(tl.int64)
    row0 = tl.load(block_row_ptr + blk)  # first query row of this block inside its sequence
    q_begin = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_begin
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    q = tl.load(q_ptr + (q_begin + offs_m[:, None]) * q_n + h * q_h + offs_d[None, :] * q_d,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = kv_len - q_len + offs_m  # absolute position of each query
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.minimum(kv_len, kv_len - q_len + row0 + BLOCK_M)  # keys past the block's last query are unseen
    qk_scale = scale * 1.4426950408889634  # exp -> exp2
    for n0 in range(0, last, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < last
        page = tl.load(tables_ptr + seq * t_s + (offs_n // page_size) * t_p, mask=mask_n, other=0).to(tl.int64)
        within = offs_n % page_size
        kv_mask = mask_n[None, :] & mask_d[:, None]
        kT = tl.load(k_ptr + page[None, :] * k_p + within[None, :] * k_o + kvh * k_h + offs_d[:, None] * k_d,
                     mask=kv_mask, other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_ptr + page[:, None] * v_p + within[:, None] * v_o + kvh * v_h + offs_d[None, :] * v_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _online_softmax_step(tl.dot(q, kT.to(q.dtype)) * qk_scale, v, offs_n, q_pos, kv_start,
                                             mask_n, m_i, l_i, acc)
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_begin + offs_m[:, None]) * o_n + h * o_h + offs_d[None, :] * o_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@lean_launch
@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cu_q_ptr, kv_lens_ptr, tables_ptr,
    scale, v_scale, page_size, heads_per_kv, num_q_heads, Dh, kv_start, num_splits, row_blocks,
    q_n, q_h, q_d, k_p, k_o, k_h, k_d, v_p, v_o, v_h, v_d, o_n, o_h, o_d, t_s, t_p,
    T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // row_blocks
    rb = tl.program_id(1) % row_blocks
    split = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_begin
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query head of this KV head, query token) pairs
    g = rows // T
    t = rows % T
    h = kvh * heads_per_kv + g  # query head of each row
    mask_m = (g < heads_per_kv) & (t < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    q = tl.load(q_ptr + (q_begin + t[:, None]) * q_n + h[:, None] * q_h + offs_d[None, :] * q_d,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = kv_len - q_len + t  # absolute position of each row's query
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N  # keys of this split, tile aligned
    lo = split * per_split
    hi = tl.minimum(kv_len, lo + per_split)  # the last query sees key kv_len - 1 at most
    qk_scale = scale * 1.4426950408889634  # exp -> exp2
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = tl.load(tables_ptr + seq * t_s + (offs_n // page_size) * t_p, mask=mask_n, other=0).to(tl.int64)
        within = offs_n % page_size
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + page[:, None] * k_p + within[:, None] * k_o + kvh * k_h + offs_d[None, :] * k_d,
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + page[:, None] * v_p + within[:, None] * v_o + kvh * v_h + offs_d[None, :] * v_d,
                    mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D] (fp8 pages: widened here)
        m_i, l_i, acc = _online_softmax_step(tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale, v, offs_n, q_pos,
                                             kv_start, mask_n, m_i, l_i, acc)
    acc = acc * v_scale  # fp8 pages hold value / v_scale (k_scale is folded into `scale` by the caller)
    if SPLIT:  # partial result of this split: unnormalised acc, running max (log2 units) and sum, fp32
        idx = ((seq * num_splits + split) * num_q_heads + h) * T + t  # [BLOCK_M] into [S, splits, Hq, T]
        tl.store(m_ptr + idx, m_i, mask=mask_m)
        tl.store(l_ptr + idx, l_i, mask=mask_m)
        tl.store(acc_ptr + idx[:, None] * Dh + offs_d[None, :], acc, mask=mask_m[:, None] & mask_d[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_begin + t[:, None]) * o_n + h[:, None] * o_h + offs_d[None, :] * o_d,
                 out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@lean_launch
@triton.jit
def _combine_splits_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, cu_q_ptr, num_q_heads, Dh, num_splits, o_n, o_h, o_d,
    T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_begin
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = (offs_s < num_splits) & ((offs_s * 0 + t) < q_len)  # rows past q_len hold no partial results
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    idx = ((seq * num_splits + offs_s) * num_q_heads + h) * T + t  # [BLOCK_S]
    m = tl.load(m_ptr + idx, mask=mask_s, other=-float("inf"))
    row_sum = tl.load(l_ptr + idx, mask=mask_s, other=0.0)  # each split's softmax denominator
    acc = tl.load(acc_ptr + idx[:, None] * Dh + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :],
                  other=0.0)  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == -float("inf"), 0.0, m_max))  # splits that saw no key weigh 0
    denom = tl.sum(w * row_sum, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)  # [BLOCK_D]
    tl.store(out_ptr + (q_begin + t) * o_n + h * o_h + offs_d * o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d & ((offs_d * 0 + t) < q_len))


@functools.cache
def _cuda_sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (cached: the query is not free)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs to fill: the real count on CUDA, a fixed small value under the interpreter."""
    if device.type != "cuda" or interpreting():
        return _INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(programs: int, max_keys: int, sms: int) -> int:
    """KV splits per (sequence, KV head): up to ~2 programs per SM, each split >= MIN_SPLIT_KEYS keys.

    `programs` = sequences x KV heads x row blocks; `max_keys` = block_tables.shape[1] x page size (host-known)."""
    splits = (2 * sms) // max(programs, 1)
    splits = min(splits, -(-max_keys // MIN_SPLIT_KEYS), MAX_SPLITS)
    return max(1, splits)


def paged_decode_attention_triton(
    q: torch.Tensor,  # [N, Hq, Dh] packed queries, at most max_query_len per sequence
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh] (any strides)
    v_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S + 1]
    kv_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_pages]
    scale: float,
    max_query_len: int,
    kv_start: int = 0,
    *,
    num_splits: int | None = None,  # None: choose_num_splits
    out: torch.Tensor | None = None,  # [N, Hq, Dh]; written only at the rows of real query tokens
    block_n: int = DECODE_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,  # fp8 pages hold key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode / verify attention: one program per (sequence, KV head, KV split) with all its query heads x
    tokens packed into the rows of one tl.dot, so K/V are read once per KV head; flash-decoding splits fill
    the GPU at small batch. No host sync: everything is derived from host-known shapes (graph-capturable)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads = kv_lens.shape[0], k_pages.shape[2]
    heads_per_kv = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return out
    rows = heads_per_kv * max_query_len
    block_m = min(max(16, next_pow2(rows)), 64)
    row_blocks = -(-rows // block_m)
    page_size = k_pages.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads * row_blocks, block_tables.shape[1] * page_size,
                                       sm_count(q.device))
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    block_d = max(16, next_pow2(head_dim))
    split = num_splits > 1
    pdl = pdl_launch(q.device)
    if split:  # fp32 scratch: [S, splits, Hq, T] running max / sum and [S, splits, Hq, T, Dh] partial outputs
        m_part = torch.empty(num_seqs, num_splits, num_q_heads, max_query_len, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(*m_part.shape, head_dim, dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads * row_blocks, num_splits)](
        q, k_pages, v_pages, out, m_part, l_part, acc_part, cu_seqlens_q, kv_lens, block_tables,
        scale * k_scale, v_scale, page_size, heads_per_kv, num_q_heads, head_dim, kv_start, num_splits, row_blocks,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *out.stride(), *block_tables.stride(),
        T=max_query_len, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if split:
        _combine_splits_kernel[(num_seqs, num_q_heads, max_query_len)](
            out, m_part, l_part, acc_part, cu_seqlens_q, num_q_heads, head_dim, num_splits, *out.stride(),
            T=max_query_len, BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=block_d, num_warps=4, **pdl,
        )
    return out


def paged_attention_triton(
    q: torch.Tensor,  # [N, Hq, Dh] packed queries
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh] (any strides)
    v_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S + 1]
    kv_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_pages]
    scale: float,
    max_query_len: int | None = None,  # host-known bound on new tokens per sequence; <= 16 skips a host sync
    kv_start: int = 0,  # keys before this position are masked
    blocks: QueryBlocks | None = None,  # the prefill work list (from the host's query lengths: no sync)
    k_scale: float = 1.0,  # fp8 pages hold key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton version of `paged_attention_ref`; returns [N, Hq, Dh] in q's dtype.

    With `max_query_len` <= DECODE_MAX_QUERY (decode, verify) the decode path runs and nothing is read back to
    the host, so the call can be captured in a CUDA graph."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    check_same_device(q, k_pages, v_pages, cu_seqlens_q, kv_lens, block_tables)
    if blocks is not None:
        max_query_len = max(blocks.query_lens, default=0)
    elif max_query_len is None or max_query_len > DECODE_MAX_QUERY:
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()  # host sync: prefill without a work list only
        max_query_len = max(lens, default=0)
        if max_query_len > DECODE_MAX_QUERY:
            blocks = query_blocks(lens, q.device)
    if max_query_len <= DECODE_MAX_QUERY:
        return paged_decode_attention_triton(q, k_pages, v_pages, cu_seqlens_q, kv_lens, block_tables, scale,
                                             max_query_len, kv_start, k_scale=k_scale, v_scale=v_scale)
    assert blocks is not None  # built above for every prefill batch
    out = torch.empty_like(q)
    block_m = PREFILL_BLOCK_M
    if blocks.seq.numel() == 0 or q.shape[0] == 0:
        return out
    block_seq_t, block_row_t = blocks.seq, blocks.row
    _paged_attention_kernel[(block_seq_t.numel(), num_q_heads)](
        q, k_pages, v_pages, out, cu_seqlens_q, kv_lens, block_tables, block_seq_t, block_row_t,
        scale * k_scale, v_scale, k_pages.shape[1], num_q_heads // num_kv_heads, head_dim, kv_start,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *out.stride(), *block_tables.stride(),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=max(16, next_pow2(head_dim)), num_warps=4, num_stages=2,
    )
    return out


@lean_launch
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, page_size, Hkv, Dh, inv_k_scale, inv_v_scale,
    k_n, k_h, k_d, v_n, v_h, v_d, kp_p, kp_o, kp_h, kp_d, vp_p, vp_o, vp_h, vp_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < Hkv) & (offs_d[None, :] < Dh) & ((offs_h * 0 + slot) >= 0)[:, None]
    page = tl.maximum(slot, 0) // page_size
    within = tl.maximum(slot, 0) % page_size
    k = tl.load(k_ptr + n * k_n + offs_h[:, None] * k_h + offs_d[None, :] * k_d, mask=mask)
    v = tl.load(v_ptr + n * v_n + offs_h[:, None] * v_h + offs_d[None, :] * v_d, mask=mask)
    if FP8:  # scaled, saturated (a plain cast past the fp8 range gives NaN), rounded to nearest even as torch
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0)  # FP8_MAX
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0)
        k = k.to(kp_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(vp_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(kp_ptr + page * kp_p + within * kp_o + offs_h[:, None] * kp_h + offs_d[None, :] * kp_d,
             k.to(kp_ptr.dtype.element_ty), mask=mask)
    tl.store(vp_ptr + page * vp_p + within * vp_o + offs_h[:, None] * vp_h + offs_d[None, :] * vp_d,
             v.to(vp_ptr.dtype.element_ty), mask=mask)


def write_kv_pages_triton(
    key: torch.Tensor,  # [N, Hkv, Dh]
    value: torch.Tensor,  # [N, Hkv, Dh]
    k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh] (any strides)
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N], -1 = padded token, skipped
    k_scale: float = 1.0,  # fp8 pages hold key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> None:
    """Triton version of `write_kv_pages`: one program per token, no host sync (graph-capturable)."""
    check_same_device(key, value, k_pages, v_pages, slot_mapping)
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_pages, v_pages, slot_mapping, k_pages.shape[1], key.shape[1], key.shape[2], 1.0 / k_scale,
        1.0 / v_scale, *key.stride(), *value.stride(), *k_pages.stride(), *v_pages.stride(),
        BLOCK_H=next_pow2(key.shape[1]), BLOCK_D=next_pow2(key.shape[2]), FP8=k_pages.dtype == torch.float8_e4m3fn,
        num_warps=2, **pdl_launch(key.device),
    )
