"""fp8 (e4m3) KV pages with per-layer scales: the torch write + reference against full-precision pages, the Triton
decode / prefill kernels reading fp8 pages against the reference, and the Triton write kernel on the GPU."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from hybridserve.kernels.paged_attention import FP8_MAX, paged_attention_ref, write_kv_pages

FP8 = torch.float8_e4m3fn


def _case(q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, page_dtype: torch.dtype, device: str,
          seed: int, k_scale: float, v_scale: float, hq: int = 8, hkv: int = 2, dh: int = 32, page: int = 16
          ) -> tuple:
    """Reference arguments with keys / values written through `write_kv_pages` into `page_dtype` pages."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // page) for n in kv_lens]
    num_pages = sum(used)
    k_pages = torch.zeros(num_pages, page, hkv, dh, dtype=page_dtype)
    v_pages = torch.zeros_like(k_pages)
    tables = torch.zeros(len(kv_lens), max(used), dtype=torch.int64)
    perm, slots = torch.randperm(num_pages, generator=gen).tolist(), []
    for seq, n in enumerate(kv_lens):
        tables[seq, : used[seq]] = torch.tensor(perm[: used[seq]])
        perm = perm[used[seq]:]
        slots += [int(tables[seq, j // page]) * page + j % page for j in range(n)]
    keys = (torch.randn(len(slots), hkv, dh, generator=gen) * 2).to(dtype)
    values = torch.randn(len(slots), hkv, dh, generator=gen).to(dtype)
    write_kv_pages(keys, values, k_pages, v_pages, torch.tensor(slots), k_scale, v_scale)
    q = torch.randn(sum(q_lens), hq, dh, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    args = (q, k_pages, v_pages, cu, torch.tensor(kv_lens), tables, dh**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.02)])
def test_fp8_pages_close_to_fp32_pages(scales: tuple[float, float]) -> None:
    """Attention over fp8 pages stays within e4m3's rounding (3 mantissa bits) of fp32 pages."""
    ks, vs = scales
    full = _case([1, 3, 20], [40, 9, 60], torch.float32, torch.float32, "cpu", 0, 1.0, 1.0)
    fp8 = _case([1, 3, 20], [40, 9, 60], torch.float32, FP8, "cpu", 0, ks, vs)
    ref = paged_attention_ref(*full)
    got = paged_attention_ref(*fp8, k_scale=ks, v_scale=vs)
    assert not got.isnan().any()
    assert ku.rel_err(got, ref) < 0.06


def test_fp8_write_saturates_instead_of_nan() -> None:
    """Values past the fp8 range (after the scale) are stored as +-448 x scale, never NaN."""
    pages = torch.zeros(1, 4, 1, 2, dtype=FP8)
    other = torch.zeros_like(pages)
    key = torch.tensor([[[1e6, -1e6]], [[3.0, -0.5]]])
    write_kv_pages(key, key, pages, other, torch.tensor([0, 1]), 0.5, 1.0)
    stored = pages.float()[0, :2, 0] * 0.5
    assert not stored.isnan().any()
    assert stored[0].tolist() == [FP8_MAX * 0.5, -FP8_MAX * 0.5]
    assert stored[1].tolist() == [3.0, -0.5]
    assert other.float()[0, 0, 0].tolist() == [FP8_MAX, -FP8_MAX]


def _triton_reads(device: str, dtype: torch.dtype, tol: float) -> None:
    from hybridserve.kernels.paged_attention_triton import paged_attention_triton

    for q_lens, max_q in (([1, 1, 1], 1), ([4, 2, 3], 4), ([40, 1, 17], None)):
        args = _case(q_lens, [70, 5, 33], dtype, FP8, device, len(q_lens) + sum(q_lens), 0.1, 0.05)
        ref = paged_attention_ref(*args, k_scale=0.1, v_scale=0.05)
        got = paged_attention_triton(*args, max_query_len=max_q, k_scale=0.1, v_scale=0.05)
        ku.assert_close(got, ref, tol, f"fp8 pages, query lens {q_lens}")


@ku.interp_only
def test_triton_reads_fp8_pages_interpreter() -> None:
    """The decode, verify and prefill kernels dequantize fp8 pages (scales folded in) as the reference does."""
    pytest.importorskip("triton")
    _triton_reads("cpu", torch.float32, 2e-3)


@ku.gpu
@ku.cuda_only
def test_triton_fp8_kv_cuda() -> None:
    """On the GPU: bf16 queries over fp8 pages against the reference, and the write kernel byte-equal to torch's
    (scaled, saturated, rounded to nearest even)."""
    from hybridserve.kernels.paged_attention_triton import write_kv_pages_triton

    _triton_reads("cuda", torch.bfloat16, 2e-2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(300, 2, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * 40
    value = torch.randn(300, 2, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    pages = [torch.zeros(20, 16, 2, 128, dtype=FP8, device="cuda") for _ in range(4)]
    slots = torch.randperm(320, device="cuda", generator=gen)[:300]
    write_kv_pages(key, value, pages[0], pages[1], slots, 0.07, 0.3)
    write_kv_pages_triton(key, value, pages[2], pages[3], slots, 0.07, 0.3)
    torch.cuda.synchronize()
    assert torch.equal(pages[0].view(torch.uint8), pages[2].view(torch.uint8))
    assert torch.equal(pages[1].view(torch.uint8), pages[3].view(torch.uint8))
