"""Triton paged attention (prefill on a cached prefix, decode, verify; GQA) against the torch reference."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.paged_attention import paged_attention_ref  # noqa: E402
from hybridserve.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402


def _check(q_lens, kv_lens, hq, hkv, dh, page, dtype, device, gen, tol, kv_start=0):
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = max_pages * len(kv_lens) + 3
    cache_k = torch.randn(num_pages, 2, page, hkv, dh, generator=gen).to(device=device, dtype=dtype)
    cache_v = torch.randn(num_pages, 2, page, hkv, dh, generator=gen).to(device=device, dtype=dtype)
    k_pages, v_pages = cache_k[:, 1], cache_v[:, 1]  # strided per-layer views
    tables = torch.randperm(num_pages, generator=gen)[: max_pages * len(kv_lens)].reshape(len(kv_lens), -1)
    q = torch.randn(sum(q_lens), hq, dh, generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=device)
    args = (q, k_pages, v_pages, cu, torch.tensor(kv_lens, device=device), tables.to(device), dh**-0.5)
    got = paged_attention_triton(*args, kv_start=kv_start)
    ku.assert_close(got, paged_attention_ref(*args, kv_start=kv_start), tol, "attention")


@ku.interp_only
def test_paged_attention_interpreter():
    _check([3, 1, 6, 0], [7, 9, 6, 2], 4, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(3), 2e-3)


@ku.interp_only
@pytest.mark.parametrize("kv_start", [0, 1])
def test_paged_attention_prefill_interpreter(kv_start):
    """More than 16 new tokens in a sequence: the prefill kernel (query blocks x query heads)."""
    _check([20, 3, 0, 70], [25, 9, 2, 75], 4, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(7), 2e-3,
           kv_start=kv_start)


@ku.interp_only
def test_paged_attention_kv_start_interpreter():
    """The MTP drafter masks key 0; a query that sees no key at all (position 0) gets zeros."""
    _check([3, 1, 6, 1], [7, 9, 6, 1], 4, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(6), 2e-3,
           kv_start=1)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("q_lens,kv_lens", [([1] * 32, [700 + 13 * i for i in range(32)]),
                                            ([4] * 8, [300 + i for i in range(8)]),
                                            ([1000, 77], [1000, 4000])])
def test_paged_attention_gpu(q_lens, kv_lens):
    _check(q_lens, kv_lens, 40, 8, 128, 16, torch.bfloat16, "cuda", torch.Generator().manual_seed(4), 2e-2)


def _write_kv(device, gen):
    from hybridserve.kernels.paged_attention import write_kv_pages
    from hybridserve.kernels.paged_attention_triton import write_kv_pages_triton

    cache = torch.randn(6, 2, 4, 2, 8, generator=gen).to(device)
    k = torch.randn(5, 2, 8, generator=gen).to(device)
    v = torch.randn(5, 2, 8, generator=gen).to(device)
    slots = torch.tensor([3, -1, 7, 21, 0], device=device)
    ref_k, ref_v = cache[:, 0].clone(), cache[:, 1].clone()
    write_kv_pages(k, v, ref_k, ref_v, slots)
    write_kv_pages_triton(k, v, cache[:, 0], cache[:, 1], slots)
    assert torch.equal(cache[:, 0], ref_k) and torch.equal(cache[:, 1], ref_v)


@ku.interp_only
def test_write_kv_interpreter():
    _write_kv("cpu", torch.Generator().manual_seed(5))


@ku.interp_only
def test_paged_attention_decode_hint_interpreter():
    gen = torch.Generator().manual_seed(6)
    q_lens, kv_lens, page = [1, 3, 2], [5, 9, 2], 4
    cache = torch.randn(12, page, 2, 8, generator=gen)
    tables = torch.randperm(12, generator=gen)[:9].reshape(3, 3)
    q = torch.randn(sum(q_lens), 4, 8, generator=gen)
    cu = torch.tensor([0, 1, 4, 6])
    args = (q, cache, cache.flip(0), cu, torch.tensor(kv_lens), tables, 0.3)
    ku.assert_close(paged_attention_triton(*args, max_query_len=3), paged_attention_ref(*args), 2e-3, "attention")


@ku.gpu
@ku.cuda_only
def test_write_kv_gpu():
    _write_kv("cuda", torch.Generator().manual_seed(5))
