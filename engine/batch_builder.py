"""Packing a step's rows into one forward: input ids and the ForwardBatch that places them (slots, pages, lengths,
checkpoint rows, verify fields), sent to the device in one copy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

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
            input_ids.extend(request.all_token_ids[start : start + count])
        rows.append(PlacedRow(request.page_ids, start, count, -1 if request.state_slot is None else request.state_slot))

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

    page_ids: list[int]
    start: int
    count: int
    state_slot: int = -1


def place_rows(
    rows: list[PlacedRow], num_decode: int, page_size: int, device: torch.device,
    extra: Sequence[Sequence[int]] = (), **fields: object,
) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """The batch metadata placing each row's tokens (slot mapping, block tables, lengths) and the `extra` int64
    arrays, all sent in one host->device copy that does not wait for the device (torch.tensor(..., device=)
    per array costs a copy and a stream sync each); `fields` adds the optional ForwardBatch fields."""
    slot_mapping: list[int] = []
    max_pages = max((len(r.page_ids) for r in rows), default=0)
    cu = [0]
    for row in rows:
        pages = row.page_ids
        if pages:
            slot_mapping.extend(pages[p // page_size] * page_size + p % page_size
                                for p in range(row.start, row.start + row.count))
        else:
            slot_mapping.extend([-1] * row.count)
        cu.append(cu[-1] + row.count)

    tables = [page for r in rows for page in (*r.page_ids, *[0] * (max_pages - len(r.page_ids)))]
    cu_t, context_t, kv_t, slots_t, tables_t, mapping_t, *extra_t = pack_to_device(
        [cu, [r.start for r in rows], [r.start + r.count for r in rows], [r.state_slot for r in rows], tables,
         slot_mapping, *extra], torch.int64, device)
    batch = ForwardBatch(
        num_decode=num_decode,
        query_lens=tuple(r.count for r in rows),
        cu_seqlens=cu_t,
        context_lens=context_t,
        kv_lens=kv_t,
        state_slots=slots_t,
        block_tables=tables_t.view(len(rows), max_pages),
        slot_mapping=mapping_t,
        context_lens_host=tuple(r.start for r in rows),
        **fields,  # type: ignore[arg-type]
    )
    return batch, extra_t


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
