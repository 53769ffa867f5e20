"""Decode graph buckets reach production batch sizes: every batch of 257 to 1,024 rows replays a graph padded by
less than 25 %, so a large running batch never pads up to max_num_seqs."""

from __future__ import annotations

from hybridserve.engine.cuda_graphs import DEFAULT_BUCKETS


def test_buckets_cover_1024_rows_with_bounded_padding() -> None:
    assert DEFAULT_BUCKETS == tuple(sorted(set(DEFAULT_BUCKETS)))
    assert DEFAULT_BUCKETS[0] == 1 and DEFAULT_BUCKETS[-1] >= 1024
    for batch in range(257, 1025):
        bucket = next(b for b in DEFAULT_BUCKETS if b >= batch)
        assert bucket < 1.25 * batch, (batch, bucket)
