"""Turns a `SchedulerOutput` into one forward over packed tokens and samples the requests that are due."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.engine.logits_processors import process_logits
from hybridserve.engine.logprobs import gather_logprobs, sampled_logprobs
from hybridserve.engine.request import Request
from hybridserve.engine.sampler import sample
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.engine.step_output import StepOutput
from hybridserve.engine.structured_output import GrammarBackend
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache


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
    layer_done: Callable[[int], None] | None = None,
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
        **({"layer_done": layer_done} if layer_done is not None else {}),
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


class ModelRunner:
    """Owns the model and its state cache on one device."""

    def __init__(
        self, model: HybridLM, cache: StateCache, page_size: int, device: torch.device, state_block: int | None = None,
        fold_decode_rows: bool = False,
    ) -> None:
        self.model = model
        self.fold_decode_rows = fold_decode_rows  # EngineConfig.fold_decode_rows
        self.num_folded_steps = 0  # mixed steps whose decode rows ran as one-token prefill chunks
        self.cache = cache
        self.page_size = page_size
        self.device = device
        self.state_block = state_block
        self.grammar: GrammarBackend | None = None  # set by the engine on its first structured request

    def execute(
        self, work: SchedulerOutput, checkpoint_slots: list[int] | None = None, verify: VerifyInputs | None = None,
        layer_done: Callable[[int], None] | None = None, while_running: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run the step and sample every request whose pending tokens are now computed (verify rows are
        left to the acceptance step: their logits come back instead). `checkpoint_slots`: from
        `StatePool.plan_checkpoints` for this step's prefill chunks; `layer_done`: `ForwardBatch.layer_done`;
        `while_running`: host work to do once the forward is queued, before the host waits for its tokens."""
        nd = len(work.decodes)
        tokens = len(verify.tokens[0]) if verify is not None and nd else 1
        chunks = [(r, tokens) for r in work.decodes] + [(c.request, c.num_tokens) for c in work.prefills]
        model_nd = nd
        if self.fold_decode_rows and nd and work.prefills and verify is None:
            # the decode rows become one-token chunks resumed from their state slot: the model sees a prefill
            model_nd, checkpoint_slots = 0, self._fold_boundaries(work.decodes, checkpoint_slots)
            self.num_folded_steps += 1
        input_ids, batch = build_forward_batch(
            chunks, model_nd, self.page_size, self.device, self.state_block, checkpoint_slots, verify, layer_done
        )
        hidden = self.model(input_ids, batch, self.cache)
        if while_running is not None:
            while_running()
        verify_logits = None
        if verify is not None and nd:
            verify_logits = self.model.compute_logits(hidden[: nd * tokens]).view(nd, tokens, -1)
        first_sampled = nd if verify is not None else 0
        due = [i for i in range(first_sampled, len(chunks)) if chunks[i][1] == chunks[i][0].num_pending_tokens]
        new_token_ids: list[list[int]] = [[] for _ in chunks]
        prompt_logprobs = self._prompt_logprobs(chunks, nd, hidden, batch)
        if not due:
            return StepOutput(hidden, batch, new_token_ids, verify_logits, first_sampled, None, prompt_logprobs)
        ends = list(itertools.accumulate(batch.query_lens))  # host copy of cu_seqlens[1:]
        rows = pack_to_device([[ends[i] - 1 for i in due]], torch.int64, self.device)[0]  # no stream sync
        last_hidden = hidden[rows]  # [num_due, hidden]
        requests = [chunks[i][0] for i in due]
        raw_logits = self.model.compute_logits(last_hidden)  # [num_due, V]; logprobs report these (as vLLM)
        logits = process_logits(raw_logits, [r.params for r in requests],
                                [(r.prompt_token_ids, r.output_token_ids) for r in requests],
                                self.model.config.eos_token_ids)
        if self.grammar is not None and any(r.grammar is not None for r in requests):
            logits = logits.float()
            self.grammar.apply(logits, [r.grammar for r in requests])
        for row, request in enumerate(requests):
            if request.hold_state:  # a prefill worker ships it to decode (the MTP drafter needs it)
                request.last_hidden = last_hidden[row]
        tokens_out = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        for index, token in zip(due, tokens_out):
            new_token_ids[index] = [token]
        logprobs: list[list[TokenLogprob]] | None = None
        wanted = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if wanted:
            logprobs = [[] for _ in chunks]
            found = sampled_logprobs(raw_logits[torch.tensor(wanted, device=logits.device)],
                                     [requests[row].params for row in wanted], [tokens_out[row] for row in wanted])
            for row, entry in zip(wanted, found):
                logprobs[due[row]] = [entry]
        return StepOutput(hidden, batch, new_token_ids, verify_logits, first_sampled, logprobs, prompt_logprobs)

    def _fold_boundaries(self, decodes: Sequence[Request], checkpoint_slots: list[int] | None) -> list[int] | None:
        """The checkpoint slots of a folded step: a decode row whose token lands on a multiple of state_block
        crosses a checkpoint boundary as a prefill chunk would; it keeps none (-1), ahead of the prefill chunks'
        boundaries (boundaries are listed in row order, decode rows first)."""
        block = self.state_block
        if not checkpoint_slots or block is None:
            return checkpoint_slots  # no boundary kept: the kernels look for none
        crossing = sum(1 for r in decodes if (r.num_computed_tokens + 1) % block == 0)
        return [-1] * crossing + checkpoint_slots

    def _prompt_logprobs(self, chunks: list[tuple[Request, int]], num_decode: int, hidden: torch.Tensor,
                         batch: ForwardBatch) -> dict[int, tuple[int, list[TokenLogprob]]] | None:
        """Raw logprobs of the prompt tokens each prefill chunk predicts, for requests that asked: the logits
        at position q score prompt token q + 1 (only those rows go through the LM head)."""
        wanted = [i for i in range(num_decode, len(chunks)) if chunks[i][0].params.prompt_logprobs is not None]
        if not wanted:
            return None
        cu = batch.cu_seqlens.tolist()
        sources: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        spans: dict[int, tuple[int, int, int]] = {}  # row -> (first position, offset into targets, count)
        for i in wanted:
            request, count = chunks[i]
            start, prompt = request.num_computed_tokens, request.prompt_token_ids
            positions = range(start + 1, min(start + count + 1, len(prompt)))
            spans[i] = (start + 1, len(targets), len(positions))
            sources.extend(cu[i] + p - 1 - start for p in positions)
            targets.extend(prompt[p] for p in positions)
            num_top.extend([request.params.prompt_logprobs or 0] * len(positions))
        if not targets:
            return None
        logits = self.model.compute_logits(hidden[torch.tensor(sources, device=hidden.device)])  # [P, V]
        entries = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, num_top)
        return {i: (first, entries[offset : offset + n]) for i, (first, offset, n) in spans.items() if n}

    def prompt_logits(self, request: Request) -> torch.Tensor:
        """Logits at every prompt position [L, vocab] for a request holding its slot and pages (one pass)."""
        input_ids, batch = build_forward_batch([(request, request.num_tokens)], 0, self.page_size, self.device)
        return self.model.compute_logits(self.model(input_ids, batch, self.cache))
