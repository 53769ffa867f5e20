"""Per-forward kernel metadata built once from host lists (no device sync per layer): it must equal what the
kernels derive from the device tensors themselves, and the Triton launchers must give the same outputs with it."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.engine.batch_builder import PlacedRow, place_rows
from hybridserve.kernels.causal_conv1d import conv_varlen_metadata
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.kernels.paged_attention import DECODE_MAX_QUERY, PREFILL_BLOCK_M
from hybridserve.kernels.ssd_scan_meta import ChunkMeta, chunk_metadata

CPU = torch.device("cpu")
seqs = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 70)), min_size=1, max_size=5)  # (new tokens, start)


def _same_meta(a: ChunkMeta, b: ChunkMeta) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        else:
            assert value == other, name


def _batch(num_decode: int, rows: list[tuple[int, int]]) -> object:
    placed = [PlacedRow([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], start, count, i) for i, (count, start) in enumerate(rows)]
    return place_rows(placed, num_decode, 16, CPU)[0]


@settings(max_examples=40, deadline=None)
@given(rows=seqs, num_decode=st.integers(0, 2), block=st.sampled_from([None, 8, 16]))
def test_batch_chunk_meta_matches_device_derived(rows: list[tuple[int, int]], num_decode: int,
                                                 block: int | None) -> None:
    decodes = [(1, 50 + i) for i in range(num_decode)]
    batch = _batch(num_decode, decodes + rows)
    meta = batch.prefill_chunk_meta(8, block)
    assert batch.prefill_chunk_meta(8, block) is meta  # built once per forward, shared by every layer
    expected = chunk_metadata(batch.prefill_cu_seqlens(), batch.context_lens[num_decode:], 8, block, CPU)
    _same_meta(meta, expected)


@settings(max_examples=40, deadline=None)
@given(rows=seqs, block=st.sampled_from([None, 4, 16]))
def test_conv_meta_lists(rows: list[tuple[int, int]], block: int | None) -> None:
    lens, starts = [n for n, _ in rows], [s for _, s in rows]
    meta = conv_varlen_metadata(lens, starts, block, CPU)
    assert meta.token_seq.tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
    expected = [(i, p) for i, (n, s) in enumerate(rows) if block for p in range(s + 1, s + n + 1) if p % block == 0]
    assert list(zip(meta.boundary_seq, meta.boundary_pos)) == expected
    assert meta.gather_seq.tolist() == list(range(len(rows))) + meta.boundary_seq
    assert meta.gather_len.tolist() == lens + [p - starts[s] for s, p in expected]


def test_attention_blocks_only_for_prefill() -> None:
    assert _batch(3, [(1, 5), (1, 9), (DECODE_MAX_QUERY, 0)]).attention_blocks() is None  # decode / verify kernel
    batch = _batch(1, [(1, 5), (PREFILL_BLOCK_M + 3, 0), (20, 4)])
    blocks = batch.attention_blocks()
    assert blocks is not None and batch.attention_blocks() is blocks
    assert blocks.seq.tolist() == [0, 1, 1, 2]
    assert blocks.row.tolist() == [0, 0, PREFILL_BLOCK_M, 0]


def test_context_lens_host_is_filled() -> None:
    batch = _batch(0, [(3, 4), (5, 0)])
    assert batch.context_lens_host == (4, 0)


@pytest.mark.skipif(not ku.INTERPRETING and not torch.cuda.is_available(), reason="needs triton")
def test_conv_launcher_rejects_metadata_of_another_batch() -> None:
    pytest.importorskip("triton")
    from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_varlen_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(7, 8, device=device)
    weight = torch.randn(8, 4, device=device)
    cu = torch.tensor([0, 3, 7], device=device)
    wrong = conv_varlen_metadata([3, 5], None, None, torch.device(device))
    with pytest.raises(ValueError, match="conv metadata describes"):
        causal_conv1d_varlen_triton(x, weight, None, cu, meta=wrong)
    right = conv_varlen_metadata([3, 4], None, None, torch.device(device))
    with_meta = causal_conv1d_varlen_triton(x, weight, None, cu, meta=right)
    without = causal_conv1d_varlen_triton(x, weight, None, cu)
    assert torch.equal(with_meta.y, without.y) and torch.equal(with_meta.final_windows, without.final_windows)


@settings(max_examples=30, deadline=None)
@given(rows=seqs, num_decode=st.integers(0, 3), block=st.sampled_from([None, 8]))
def test_every_kernel_index_array_is_16_byte_aligned(rows: list[tuple[int, int]], num_decode: int,
                                                     block: int | None) -> None:
    """Triton compiles a variant per pointer alignment: whatever the batch, every index array must be aligned."""
    decodes = [(1, 50 + i) for i in range(num_decode)]
    batch = _batch(num_decode, decodes + [(max(n, 17), s) for n, s in rows])
    tensors = [v for v in vars(batch.prefill_chunk_meta(8, block)).values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in vars(batch.prefill_conv_meta(block)).values() if isinstance(v, torch.Tensor)]
    blocks = batch.attention_blocks()
    assert blocks is not None
    tensors += [blocks.seq, blocks.row, *batch.prefill_rows()]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


@given(arrays=st.lists(st.lists(st.integers(-5, 5), max_size=9), max_size=6),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_pack_to_device_keeps_values_and_alignment(arrays: list[list[int]], dtype: torch.dtype) -> None:
    views = pack_to_device(arrays, dtype, CPU)
    assert [v.tolist() for v in views] == arrays
    assert all(v.data_ptr() % 16 == 0 and v.dtype == dtype for v in views)
