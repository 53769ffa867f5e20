"""Triton paged attention (prefill on a cached prefix, decode, verify; GQA) against the torch reference."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.paged_attention import paged_attention_ref  # noqa: E402
from hybridserve.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402


def _check(q_lens, kv_lens, hq, hkv, dh, page, dtype, device, gen, tol):
    max_pages = max(-(-n // page) for n in kv_lens)
    num_pages = max_pages * len(kv_lens) + 3
    cache_k = torch.randn(num_pages, 2, page, hkv, dh, generator=gen).to(device=device, dtype=dtype)
    cache_v = torch.randn(num_pages, 2, page, hkv, dh, generator=gen).to(device=device, dtype=dtype)
    k_pages, v_pages = cache_k[:, 1], cache_v[:, 1]  # strided per-layer views
    tables = torch.randperm(num_pages, generator=gen)[: max_pages * len(kv_lens)].reshape(len(kv_lens), -1)
    q = torch.randn(sum(q_lens), hq, dh, generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=device)
    args = (q, k_pages, v_pages, cu, torch.tensor(kv_lens, device=device), tables.to(device), dh**-0.5)
    ku.assert_close(paged_attention_triton(*args), paged_attention_ref(*args), tol, "attention")


@ku.interp_only
def test_paged_attention_interpreter():
    _check([3, 1, 6, 0], [7, 9, 6, 2], 4, 2, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(3), 2e-3)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("q_lens,kv_lens", [([1] * 32, [700 + 13 * i for i in range(32)]),
                                            ([4] * 8, [300 + i for i in range(8)]),
                                            ([1000, 77], [1000, 4000])])
def test_paged_attention_gpu(q_lens, kv_lens):
    _check(q_lens, kv_lens, 40, 8, 128, 16, torch.bfloat16, "cuda", torch.Generator().manual_seed(4), 2e-2)
