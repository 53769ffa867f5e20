"""Drafting with the checkpoint's MTP module.

Slot q of the drafter pairs token x_q with the target's hidden state h_{q-1} (models/mtp.py). After every
step the drafter catches up over the slots the target just finalised — [computed before, computed after],
the first one fed by the hidden state carried from the previous step (`StateCache.hidden_states`, which
prefix-cache checkpoints keep too) — and, for requests that go on decoding, its last slot yields draft 1;
K-1 single-slot passes feeding the drafter's own output back yield drafts 2..K. Draft slots beyond the
accepted tokens are overwritten by the next catch-up, like the target's rejected KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridserve.engine.batch_builder import PlacedRow, place_rows
from hybridserve.engine.request import Request
from hybridserve.engine.sampler import draw, params_probs
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache


@dataclass(frozen=True)
class CatchUp:
    """One request's drafter work after a step: slots [start, last], and whether to draft after `last`."""

    request: Request
    start: int  # computed tokens before the step (its slot is fed by the carried hidden state)
    last: int  # last slot to compute (the computed count after the step, or one less)
    hidden_rows: torch.Tensor  # [computed after - start, hidden] the step's target hidden states h_start..
    draft: bool


class DrafterCalls(Protocol):
    """The model calls the drafter makes (`ModelRunner`'s: they reach every rank under tensor parallelism)."""

    model: HybridLM

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, batch: ForwardBatch,
                    cache: StateCache) -> torch.Tensor: ...


def _slot_batch(rows: list[tuple[Request, int, int]], page_size: int, device: torch.device) -> ForwardBatch:
    """A prefill-shaped batch placing `count` drafter slots of each request from position `start` (the drafter
    has no Mamba layers: no state slots)."""
    return place_rows([PlacedRow(r.page_ids, start, count) for r, start, count in rows], 0, page_size, device)[0]


class MTPDrafter:
    """Runs the drafter's catch-up and draft passes for a batch of requests."""

    def __init__(self, model: DrafterCalls, cache: StateCache, page_size: int, num_drafts: int) -> None:
        if cache.hidden_states.shape[0] == 0:
            raise ValueError("MTP drafting needs a model with Mamba layers (the carried hidden state lives in its slots)")
        self.model = model
        self.cache = cache
        self.page_size = page_size
        self.num_drafts = num_drafts
        self.device = cache.hidden_states.device

    def run(self, work: list[CatchUp]) -> None:
        """Catch up every request, update its carried hidden state, and set `draft_tokens` / `draft_probs`
        of those marked to draft."""
        if not work:
            return
        token_ids: list[int] = []
        prev_hidden: list[torch.Tensor] = []
        rows = []
        for item in work:
            slot = item.request.state_slot
            assert slot is not None  # the engine only passes requests that hold their slot
            tokens = item.request.all_token_ids
            token_ids += tokens[item.start : item.last + 1]
            carry = self.cache.hidden_states[slot] if item.start > 0 else torch.zeros_like(self.cache.hidden_states[0])
            prev_hidden.append(carry[None].to(self.cache.hidden_states.dtype))
            prev_hidden.append(item.hidden_rows[: item.last - item.start].to(self.cache.hidden_states.dtype))
            rows.append((item.request, item.start, item.last - item.start + 1))
        batch = _slot_batch(rows, self.page_size, self.device)
        drafting = [i for i, item in enumerate(work) if item.draft]
        # one host->device copy that does not wait for the device (torch.tensor(..., device=) waits for the stream)
        ids, drafting_rows = pack_to_device([token_ids, [i + 1 for i in drafting]], torch.int64, self.device)
        drafter_hidden = self.model.mtp_forward(ids, torch.cat(prev_hidden), batch, self.cache)
        for item in work:  # carry h_{computed - 1} to the next step (after reading the old carry above)
            if item.hidden_rows.shape[0]:
                self.cache.hidden_states[item.request.state_slot] = item.hidden_rows[-1]
        for item in work:
            if not item.draft:
                item.request.draft_tokens, item.request.draft_probs = [], None
        if drafting:
            last_rows = batch.cu_seqlens[drafting_rows] - 1
            self._draft([work[i] for i in drafting], drafter_hidden[last_rows])

    def _draft(self, work: list[CatchUp], hidden: torch.Tensor) -> None:
        """hidden [R, hidden]: the drafter state of each request's last caught-up slot -> K drafts each."""
        requests = [item.request for item in work]
        chosen_steps: list[torch.Tensor] = []  # [R] per draft step, kept on the device: one host read at the end
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(self.num_drafts):
            logits = self.model.compute_logits(hidden)  # [R, V]
            chosen = logits.argmax(dim=-1)
            sampled = [row for row, r in enumerate(requests) if not r.params.greedy]
            if sampled:  # drafts from q = the request's own processed distribution (rejection needs q)
                sampled_rows = pack_to_device([sampled], torch.int64, logits.device)[0]
                q = params_probs(logits[sampled_rows], [requests[row].params for row in sampled])
                chosen[sampled_rows] = draw(q, [requests[row].generator for row in sampled])
                for i, row in enumerate(sampled):
                    probs[row].append(q[i])
            chosen_steps.append(chosen)
            if step == self.num_drafts - 1:
                break
            rows = [(item.request, item.last + 1 + step, 1) for item in work]
            batch = _slot_batch(rows, self.page_size, self.device)
            hidden = self.model.mtp_forward(chosen, hidden, batch, self.cache)
        drafts: list[list[int]] = torch.stack(chosen_steps, dim=1).tolist()  # [R, K]: the drafting's one sync
        for row, request in enumerate(requests):
            request.draft_tokens = drafts[row]
            request.draft_probs = torch.stack(probs[row]) if probs[row] else None
