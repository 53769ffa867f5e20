"""Triton causal GQA attention over the paged KV cache (prefill on a cached prefix, decode, verify).

One program per (block of BLOCK_M query tokens of one sequence, query head): online softmax over key tiles
of BLOCK_N tokens gathered page by page through the block table, stopping at the block's last visible key.
Pages are read through their strides (the per-layer views of the request-major cache are strided).
Reference and contract: `hybridserve.kernels.paged_attention.paged_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.triton_utils import check_same_device, next_pow2


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, tables_ptr, block_seq_ptr, block_row_ptr,
    scale, page_size, heads_per_kv, Dh, kv_start,
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
        s = tl.dot(q, kT.to(q.dtype)) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] >= kv_start) & mask_n[None, :]
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + page[:, None] * v_p + within[:, None] * v_o + kvh * v_h + offs_d[None, :] * v_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_begin + offs_m[:, None]) * o_n + h * o_h + offs_d[None, :] * o_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


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
) -> torch.Tensor:
    """Triton version of `paged_attention_ref`; returns [N, Hq, Dh] in q's dtype.

    With `max_query_len` <= 16 (decode, verify) every sequence is one query block and nothing is read back
    to the host, so the call can be captured in a CUDA graph."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    check_same_device(q, k_pages, v_pages, cu_seqlens_q, kv_lens, block_tables)
    out = torch.empty_like(q)
    num_seqs = kv_lens.shape[0]
    if max_query_len is not None and max_query_len <= 16:
        block_m = 16
        block_seq_t = torch.arange(num_seqs, dtype=torch.int32, device=q.device)
        block_row_t = torch.zeros(num_seqs, dtype=torch.int32, device=q.device)
    else:
        bounds = cu_seqlens_q.tolist()
        max_q = max((bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)), default=0)
        block_m = 16 if max_q <= 16 else 64
        block_seq, block_row = [], []
        for seq in range(len(bounds) - 1):
            for row in range(0, bounds[seq + 1] - bounds[seq], block_m):
                block_seq.append(seq)
                block_row.append(row)
        block_seq_t = torch.tensor(block_seq, dtype=torch.int32).to(q.device)
        block_row_t = torch.tensor(block_row, dtype=torch.int32).to(q.device)
    if block_seq_t.numel() == 0 or q.shape[0] == 0:
        return out
    _paged_attention_kernel[(block_seq_t.numel(), num_q_heads)](
        q, k_pages, v_pages, out, cu_seqlens_q, kv_lens, block_tables, block_seq_t, block_row_t,
        scale, k_pages.shape[1], num_q_heads // num_kv_heads, head_dim, kv_start,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *out.stride(), *block_tables.stride(),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=max(16, next_pow2(head_dim)), num_warps=4, num_stages=2,
    )
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, page_size, Hkv, Dh,
    k_n, k_h, k_d, v_n, v_h, v_d, kp_p, kp_o, kp_h, kp_d, vp_p, vp_o, vp_h, vp_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < Hkv) & (offs_d[None, :] < Dh) & ((offs_h * 0 + slot) >= 0)[:, None]
    page = tl.maximum(slot, 0) // page_size
    within = tl.maximum(slot, 0) % page_size
    k = tl.load(k_ptr + n * k_n + offs_h[:, None] * k_h + offs_d[None, :] * k_d, mask=mask)
    v = tl.load(v_ptr + n * v_n + offs_h[:, None] * v_h + offs_d[None, :] * v_d, mask=mask)
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
) -> None:
    """Triton version of `write_kv_pages`: one program per token, no host sync (graph-capturable)."""
    check_same_device(key, value, k_pages, v_pages, slot_mapping)
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_pages, v_pages, slot_mapping, k_pages.shape[1], key.shape[1], key.shape[2],
        *key.stride(), *value.stride(), *k_pages.stride(), *v_pages.stride(),
        BLOCK_H=next_pow2(key.shape[1]), BLOCK_D=next_pow2(key.shape[2]), num_warps=2,
    )
