"""Triton decode / verify paged attention (packed GQA rows, flash-decoding splits) against the torch reference."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.paged_attention import paged_attention_ref, write_kv_pages  # noqa: E402
from hybridserve.kernels.paged_attention_triton import (  # noqa: E402
    MAX_SPLITS,
    choose_num_splits,
    paged_attention_triton,
    paged_decode_attention_triton,
)


def _inputs(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, dh: int, page: int, dtype: torch.dtype,
            device: str, gen: torch.Generator, pad_pages: int = 0) -> tuple:
    """Reference arguments. Every page slot past a sequence's kv_len is NaN, and block-table columns past its
    last page (plus `pad_pages` extra columns) name an all-NaN page, so a read outside the contract shows up."""
    used = [-(-n // page) for n in kv_lens]
    num_pages = sum(used) + 1  # the last page is never written (poison)
    cache_k = torch.full((num_pages, 2, page, hkv, dh), float("nan"), dtype=dtype)
    cache_v = cache_k.clone()
    k_pages, v_pages = cache_k[:, 1], cache_v[:, 1]  # strided per-layer views
    perm = torch.randperm(num_pages - 1, generator=gen).tolist()
    tables = torch.full((len(kv_lens), max(used) + pad_pages), num_pages - 1, dtype=torch.int64)
    slots = []
    for seq, n in enumerate(kv_lens):
        tables[seq, : used[seq]] = torch.tensor([perm.pop() for _ in range(used[seq])], dtype=torch.int64)
        slots += [int(tables[seq, j // page]) * page + j % page for j in range(n)]
    keys = torch.randn(len(slots), hkv, dh, generator=gen).to(dtype)
    values = torch.randn(len(slots), hkv, dh, generator=gen).to(dtype)
    write_kv_pages(keys, values, k_pages, v_pages, torch.tensor(slots, dtype=torch.int64))
    q = torch.randn(sum(q_lens), hq, dh, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    args = (q, k_pages, v_pages, cu, torch.tensor(kv_lens), tables, dh**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _check_decode(args: tuple, max_q: int, tol: float, kv_start: int = 0, **kw) -> None:
    """Decode path into a NaN-poisoned buffer (every real query row must be written) vs the reference."""
    q = args[0]
    out = ku.poisoned(tuple(q.shape), q.dtype, q.device)
    got = paged_decode_attention_triton(*args, max_q, kv_start, out=out, **kw)
    assert got is out
    ku.assert_close(got, paged_attention_ref(*args, kv_start=kv_start), tol, f"decode attention {kw}")


GQA = [(3, 3), (4, 2), (10, 2), (20, 1)]  # GQA 1, 2, 5 and 20 (80 rows at T=4: two row blocks)


@ku.interp_only
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_interpreter(hq: int, hkv: int, T: int, splits: int) -> None:
    """Contexts crossing many pages and key tiles; ragged query counts (and an empty sequence) at T = 4."""
    q_lens = [1, 1, 1, 1] if T == 1 else [4, 2, 4, 0]
    args = _inputs(q_lens, [37, 70, 5, 16], hq, hkv, 24, 4, torch.float32, "cpu", torch.Generator().manual_seed(T))
    _check_decode(args, T, 2e-3, num_splits=splits, block_n=16)


@ku.interp_only
@pytest.mark.parametrize("kv_start", [1, 6, 40])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kv_start_interpreter(kv_start: int, splits: int) -> None:
    """Masked leading keys, including whole splits and whole sequences that see no key (rows of zeros)."""
    args = _inputs([4, 1, 3, 2], [37, 70, 3, 45], 10, 2, 16, 4, torch.float32, "cpu",
                   torch.Generator().manual_seed(kv_start))
    _check_decode(args, 4, 2e-3, kv_start=kv_start, num_splits=splits, block_n=16)


@ku.interp_only
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_padded_tables_interpreter(splits: int) -> None:
    """Block tables wider than any sequence needs, padded with a NaN page; a partly filled last page."""
    args = _inputs([1, 1, 1], [9, 33, 1], 10, 2, 16, 8, torch.float32, "cpu", torch.Generator().manual_seed(9),
                   pad_pages=4)
    _check_decode(args, 1, 2e-3, num_splits=splits, block_n=16)


@ku.interp_only
def test_decode_more_splits_than_tiles_interpreter() -> None:
    """More splits than key tiles: the trailing splits are empty and must weigh nothing in the combine."""
    args = _inputs([1, 2], [20, 7], 4, 2, 16, 4, torch.float32, "cpu", torch.Generator().manual_seed(2))
    _check_decode(args, 2, 2e-3, num_splits=7, block_n=16)


@ku.interp_only
@pytest.mark.parametrize("max_q", [None, 4, 16])
def test_public_dispatch_interpreter(max_q: int | None) -> None:
    """The public launcher takes the decode path for <= 16 new tokens, with or without the hint."""
    args = _inputs([4, 3, 1], [50, 3, 20], 10, 2, 16, 16, torch.float32, "cpu", torch.Generator().manual_seed(1))
    ku.assert_close(paged_attention_triton(*args, max_query_len=max_q), paged_attention_ref(*args), 2e-3, "public")


@ku.interp_only
def test_decode_path_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the hint, the launcher never reads a device tensor back (so a CUDA graph can capture it)."""
    args = _inputs([1, 1], [30, 70], 10, 2, 16, 16, torch.float32, "cpu", torch.Generator().manual_seed(4))
    ref = paged_attention_ref(*args)

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in the decode path")

    for name in ("tolist", "item", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    from hybridserve.kernels import paged_attention_triton as mod

    chosen = []
    monkeypatch.setattr(mod, "choose_num_splits", lambda *a: chosen.append(a) or 3)  # split + combine kernels
    got = paged_attention_triton(*args, max_query_len=1)
    with pytest.raises(AssertionError, match="host sync"):  # the patch is live: the prefill path trips it
        paged_attention_triton(*args)
    monkeypatch.undo()
    assert chosen == [(2 * 2 * 1, 5 * 16, mod.sm_count(args[0].device))]
    ku.assert_close(got, ref, 2e-3, "no-sync decode")


def test_choose_num_splits() -> None:
    """Splits fill ~2 programs per SM at small batch, never below MIN_SPLIT_KEYS keys each, 1 at large batch."""
    assert choose_num_splits(8, 32768, 132) == 33  # batch 1, 8 KV heads, H100
    assert choose_num_splits(8, 512, 132) == 8  # short context: 64 keys per split at least
    assert choose_num_splits(32 * 8, 32768, 132) == 1
    assert choose_num_splits(128 * 8, 4096, 132) == 1
    assert choose_num_splits(1, 10**7, 1000) == MAX_SPLITS
    assert choose_num_splits(8, 16, 132) == 1


def _nemotron(batch: int, T: int, context: int, seed: int) -> tuple:
    kv_lens = [context + 37 * i for i in range(batch)]
    return _inputs([T] * batch, kv_lens, 40, 8, 128, 16, torch.bfloat16, "cuda", torch.Generator().manual_seed(seed))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("batch,T,context", [(1, 1, 4000), (1, 4, 700), (3, 4, 2000), (32, 1, 700), (33, 4, 300)])
@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize("kv_start", [0, 1])
def test_decode_gpu(batch: int, T: int, context: int, splits: int | None, kv_start: int) -> None:
    _check_decode(_nemotron(batch, T, context, batch + T), T, 2e-2, kv_start=kv_start, num_splits=splits)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("T", [1, 4])
def test_decode_cuda_graph_gpu(T: int) -> None:
    """Capture the public call once, change lengths, tables and queries in place, replay: still matches."""
    q, k_pages, v_pages, cu, kv_lens, tables, scale = _nemotron(2, T, 3000, 7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention_triton(q, k_pages, v_pages, cu, kv_lens, tables, scale, max_query_len=T)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k_pages, v_pages, cu, kv_lens, tables, scale, max_query_len=T)
    kv_lens.copy_(torch.tensor([1500, 2000]))  # both within the tokens written on the swapped pages
    tables.copy_(tables.flip(0))
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, k_pages, v_pages, cu, kv_lens, tables, scale)
    ku.assert_close(out, ref, 2e-2, "graph replay")
