"""Packing a step's rows into one forward: input ids and the ForwardBatch that places them (slots, pages, lengths,
checkpoint rows, verify fields), sent to the device in one copy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.engine.request import Request
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.models.forward_batch import ForwardBatch


@dataclass(frozen=True)
class VerifyInputs:
    """The decode rows of a speculative step: each feeds its last token plus drafts (T tokens in all)."""

    tokens: list[list[int]]  # per decode row, T input tokens
    rollback: str  # "intermediate" | "replay"
    num_replay: list[int]  # per decode row, tokens of its previous verify to fold in (replay)


def build_forward_batch(
    chunks: list[tuple[Request, int]],
    num_decode: int,
    page_size: int,
    device: torch.device,
    state_block: int | None = None,
    checkpoint_slots: list[int] | None = None,
    verify: VerifyInputs | None = None,
) -> tuple[torch.Tensor, ForwardBatch]:
    """(request, new token count) pairs, decodes first -> (input ids [N], batch metadata).
    `checkpoint_slots`: one slot (or -1) per state_block boundary the prefill chunks cross, in chunk then
    position order; the Mamba layers write their state at those boundaries there. With `verify` the decode
    rows take its T tokens each instead of their one pending token."""
    input_ids: list[int] = []
    rows = []
    for index, (request, count) in enumerate(chunks):
        start = request.num_computed_tokens
        if verify is not None and index < num_decode:
            input_ids.extend(verify.tokens[index])
        else:
            input_ids.extend(request.token_ids(start, start + count))
        slot = request.state_slot
        rows.append(PlacedRow(request.page_array(), start, count, -1 if slot is None else slot))

    boundary_rows = _checkpoint_rows(state_block, checkpoint_slots or [])
    batch, (ids, *kept) = place_rows(
        rows, num_decode, page_size, device, extra=[input_ids, *([boundary_rows] if boundary_rows else [])],
        **_verify_fields(verify, num_decode, device),
    )
    if boundary_rows:
        batch = dataclasses.replace(batch, state_block=state_block, num_checkpoint_boundaries=len(boundary_rows),
                                    boundary_rows=kept[0])
    return ids, batch


@dataclass(frozen=True)
class PlacedRow:
    """`count` new tokens of one sequence from position `start`, in its KV pages and state slot."""

    page_ids: Sequence[int] | np.ndarray  # a Request's page_array() on the step's path
    start: int
    count: int
    state_slot: int = -1


def place_rows(
    rows: list[PlacedRow], num_decode: int, page_size: int, device: torch.device,
    extra: Sequence[Sequence[int]] = (), **fields: object,
) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """The batch metadata placing each row's tokens (slot mapping, block tables, lengths) and the `extra` int64
    arrays, all sent in one host->device copy that does not wait for the device (torch.tensor(..., device=)
    per array costs a copy and a stream sync each); `fields` adds the optional ForwardBatch fields. Built with
    numpy over the whole batch: at 1,024 rows a per-token Python loop over the block tables cost tens of ms."""
    num_rows = len(rows)
    pages = [np.asarray(r.page_ids, dtype=np.int64) for r in rows]
    num_pages = np.fromiter((len(p) for p in pages), dtype=np.int64, count=num_rows)
    max_pages = int(num_pages.max()) if num_rows else 0
    starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=num_rows)
    counts = np.fromiter((r.count for r in rows), dtype=np.int64, count=num_rows)
    slots = np.fromiter((r.state_slot for r in rows), dtype=np.int64, count=num_rows)
    cu = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    tables = np.zeros((num_rows, max_pages), dtype=np.int64)  # [S, max_pages], 0-padded
    if max_pages:
        tables[np.arange(max_pages) < num_pages[:, None]] = np.concatenate(pages)
    # slot mapping: each new token's KV slot (page * page_size + offset), -1 for a row without pages
    row_of = np.repeat(np.arange(num_rows), counts)  # [T]
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)  # [T]
    if max_pages:
        page_index = np.minimum(positions // page_size, max_pages - 1)
        mapping = tables[row_of, page_index] * page_size + positions % page_size
        mapping = np.where(num_pages[row_of] > 0, mapping, -1)
    else:
        mapping = np.full(len(positions), -1, dtype=np.int64)
    cu_t, context_t, kv_t, slots_t, tables_t, mapping_t, *extra_t = _pack(
        [cu, starts, starts + counts, slots, tables.reshape(-1), mapping,
         *(np.asarray(e, dtype=np.int64) for e in extra)], device)
    batch = ForwardBatch(
        num_decode=num_decode,
        query_lens=tuple(counts.tolist()),
        cu_seqlens=cu_t,
        context_lens=context_t,
        kv_lens=kv_t,
        state_slots=slots_t,
        block_tables=tables_t.view(num_rows, max_pages),
        slot_mapping=mapping_t,
        context_lens_host=tuple(starts.tolist()),
        **fields,  # type: ignore[arg-type]
    )
    return batch, extra_t


def _pack(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays -> one host->device copy (no host sync), one 16-byte-aligned view per array (as
    kernels.host_index.pack_to_device, for numpy inputs)."""
    per_block = 2  # int64 elements per 16 bytes
    sizes = [len(a) for a in arrays]
    padded = [n + (-n % per_block or (0 if n else per_block)) for n in sizes]
    offsets = np.concatenate([[0], np.cumsum(padded)[:-1]]).tolist() if arrays else []
    packed = np.zeros(sum(padded), dtype=np.int64)
    for array, offset, n in zip(arrays, offsets, sizes):
        packed[offset : offset + n] = array
    host = torch.from_numpy(packed)
    if device.type == "cuda":  # from pageable memory the driver may wait for the stream (async scheduling's step
        host = host.pin_memory()  # in flight) before it copies; from pinned memory the copy is queued behind it
    on_device = host.to(device, non_blocking=True)
    return [on_device[offset : offset + n] for offset, n in zip(offsets, sizes)]


def _checkpoint_rows(state_block: int | None, slots: list[int]) -> list[int]:
    """One checkpoint slot (or -1) per boundary when the batch keeps any, else [] (no checkpoint fields)."""
    if state_block is None or all(s < 0 for s in slots):
        return []
    return slots


def _verify_fields(verify: VerifyInputs | None, num_decode: int, device: torch.device) -> dict[str, object]:
    if verify is None or num_decode == 0:
        return {}
    return {
        "decode_len": len(verify.tokens[0]),
        "spec_rollback": verify.rollback,
        "num_replay": pack_to_device([verify.num_replay], torch.int32, device)[0],
    }
