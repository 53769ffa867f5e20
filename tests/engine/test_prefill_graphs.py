"""Prefill graphs (engine/prefill_graphs.py): a prefill batch padded into a captured forward's static buffers
computes what the eager forward computes; the padded index lists keep the shapes the capture fixed."""

from __future__ import annotations

import os

import pytest
import torch

from hybridserve.engine.prefill_graphs import SEQS, PrefillBuffers, PrefillShape, padded_lists
from hybridserve.kernels.ssd_scan_meta import chunk_lists

CHUNK, BLOCK = 8, 16


# "nemotron_h" (prefill-only batches and the prefill halves of mixed steps); "mamba2" (no attention) takes another
# 1-1.5 min of the CI box under the interpreter and is left out there (tests/engine/test_cuda_prefill_graphs.py
# covers both on a GPU)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nemotron_h"])
def test_padded_prefill_equals_eager_under_the_interpreter(kind: str) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("tests/engine/test_cuda_prefill_graphs.py covers this on a GPU")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    from prefill_graph_case import run

    found = run(kind)
    assert all(len(tokens) == 2 for tokens in found["tokens"])
    assert found["checked"] >= 4 and found["resumed"] and found["multi"] and found["kept"]


@pytest.mark.parametrize("lens,starts", [([43], [0]), ([11, 29, 10], [32, 32, 37]), ([1] * 7, list(range(7))),
                                         ([64], [5]), ([], [])])
def test_padded_lists_keep_the_captured_shape(lens: list[int], starts: list[int]) -> None:
    shape = PrefillShape.for_bucket(64, SEQS, CHUNK, BLOCK)
    found = padded_lists(shape, lens, starts, CHUNK, BLOCK)
    assert found is not None
    int64, int32, kept = found
    real = lens and chunk_lists([0, *[sum(lens[: i + 1]) for i in range(len(lens))]], starts, CHUNK, BLOCK)
    assert kept == (len(real.kept_seq) if real else 0)
    assert len(int64["cu"]) == SEQS + 1 and int64["cu"][-1] == 64  # every token belongs to a sequence
    assert len(int32["chunk_start"]) == shape.chunks and sum(int32["chunk_len"]) == 64
    ptr = int32["seq_chunk_ptr"]
    assert ptr[0] == 0 and ptr[-1] == shape.chunks and all(b > a for a, b in zip(ptr, ptr[1:]))  # >= 1 chunk each
    for seq in range(SEQS):  # chunks tile each sequence's tokens in order
        begin = int64["cu"][seq]
        for c in range(ptr[seq], ptr[seq + 1]):
            assert int32["chunk_start"][c] == begin or int32["chunk_len"][c] == 0
            begin += int32["chunk_len"][c]
        assert begin == int64["cu"][seq + 1]
    assert sorted(k for k in int32["keep_idx"] if k >= 0) == list(range(kept))
    assert int64["kv"][len(lens):] == [0] * (SEQS - len(lens))  # padding: no keys, so no attention
    pad = 64 - sum(lens)  # the padding sequence's queries are real work items (zeros: no keys), the rest no-ops
    padding = [(seq, row) for seq, row in zip(int32["block_seq"], int32["block_row"]) if seq >= len(lens)]
    assert [row for _, row in padding if row < 64] == list(range(0, pad, 64))
    assert all(seq == len(lens) for seq, _ in padding)


def test_padded_lists_refuse_what_the_shape_cannot_hold() -> None:
    shape = PrefillShape.for_bucket(64, SEQS, CHUNK, BLOCK)
    assert padded_lists(shape, [1] * SEQS, [0] * SEQS, CHUNK, BLOCK) is None  # no room for the padding sequence
    assert padded_lists(shape, [65], [0], CHUNK, BLOCK) is None


def test_buffers_take_only_what_fits() -> None:
    from hybridserve.engine.batch_builder import PlacedRow, place_rows

    buffers = PrefillBuffers(PrefillShape.for_bucket(64, SEQS, CHUNK, BLOCK), 8, CHUNK, BLOCK, torch.device("cpu"))
    rows = [PlacedRow([1, 2, 3], 0, 40, 0), PlacedRow([4, 5], 5, 20, 1)]
    batch, _ = place_rows(rows, 0, 16, torch.device("cpu"))
    assert buffers.fits(batch) and buffers.load(torch.arange(60), batch)
    assert buffers.state_slots.tolist() == [0, 1] + [-1] * (SEQS - 2)
    assert buffers.slot_mapping[60:].eq(-1).all() and buffers.boundary_rows.eq(-1).all()
    batch_b = buffers.new_batch()
    assert batch_b.num_tokens == 64 and batch_b.num_seqs == SEQS and batch_b.prefill_rows()[0] is buffers.state_slots
    too_many, _ = place_rows([PlacedRow([i], 0, 2, i) for i in range(SEQS)], 0, 16, torch.device("cpu"))
    assert not buffers.fits(too_many)
    decoding, _ = place_rows(rows, 1, 16, torch.device("cpu"))
    assert not buffers.fits(decoding)
