"""The batch builder's numpy placement equals the per-token definition; a request's page and token views track
its lists."""

from __future__ import annotations

import random

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.batch_builder import PlacedRow, place_rows
from hybridserve.engine.request import Request


def reference(rows: list[PlacedRow], page_size: int) -> tuple[list[int], list[list[int]]]:
    """(slot mapping, 0-padded block tables) token by token."""
    max_pages = max((len(r.page_ids) for r in rows), default=0)
    mapping: list[int] = []
    for r in rows:
        pages = list(r.page_ids)
        for p in range(r.start, r.start + r.count):
            mapping.append(pages[p // page_size] * page_size + p % page_size if pages else -1)
    tables = [list(r.page_ids) + [0] * (max_pages - len(r.page_ids)) for r in rows]
    return mapping, tables


def test_place_rows_matches_the_per_token_definition() -> None:
    rng = random.Random(0)
    page_size = 16
    rows = []
    for i in range(40):
        start = rng.randrange(0, 300)
        count = 1 if i < 30 else rng.randrange(1, 70)
        pages = rng.sample(range(1000), -(-(start + count) // page_size))
        rows.append(PlacedRow(pages, start, count, i if i % 7 else -1))
    rows.append(PlacedRow([], 5, 3, 2))  # no KV (a Mamba-only model): slots -1
    extra = [[rng.randrange(100) for _ in range(sum(r.count for r in rows))], [3, 4]]
    batch, (ids, second) = place_rows(rows, 30, page_size, torch.device("cpu"), extra=extra)
    mapping, tables = reference(rows, page_size)
    assert batch.slot_mapping.tolist() == mapping
    assert batch.block_tables.tolist() == tables
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor([r.count for r in rows]).cumsum(0).tolist()]
    assert batch.context_lens.tolist() == [r.start for r in rows]
    assert batch.kv_lens.tolist() == [r.start + r.count for r in rows]
    assert batch.state_slots.tolist() == [r.state_slot for r in rows]
    assert batch.query_lens == tuple(r.count for r in rows)
    assert batch.context_lens_host == tuple(r.start for r in rows)
    assert ids.tolist() == extra[0] and second.tolist() == [3, 4]


def test_request_views_follow_its_lists() -> None:
    request = Request("r", [5, 6, 7], SamplingParams(), seed=0, arrival=0)
    request.output_token_ids.extend([8, 9])
    for start in range(5):
        for end in range(start, 6):
            assert request.token_ids(start, end) == request.all_token_ids[start:end]
    assert request.page_array().tolist() == []
    request.page_ids = [4, 2]  # the pool's admission gives a new list
    assert request.page_array().tolist() == [4, 2]
    for page in range(40):  # then extends it
        request.page_ids.append(page)
        assert request.page_array().tolist() == request.page_ids
    request.page_ids = []  # release
    assert request.page_array().tolist() == []
