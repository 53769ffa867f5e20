"""Moving a request's state between engines: export after prefill, reserve + commit on the decode side.

Prefill side: a request added with `hold_state=True` keeps its pages and slot after its first token;
`export_state` gathers them (queued device copies, into a staging buffer when given one) and releases the
request, whose full blocks stay cached. Moving the bytes is `hybridserve.transfer`'s job.
Decode side: `reserve` admits a request with pages and a slot for its prompt but schedules nothing;
`commit` writes the received tensors into them and lets the request join the running batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.engine.request import Request, RequestStatus
from hybridserve.statepool.pool import NO_HIT
from hybridserve.transfer.state_layout import (
    StateTensorSpec,
    iter_request_state,
    request_state_specs,
    stage_request_state,
    write_request_state,
)


class CapacityError(RuntimeError):
    """The pool cannot hold the request now (try later or another worker)."""


@dataclass(frozen=True)
class ExportedState:
    specs: list[StateTensorSpec]
    parts: list[torch.Tensor]  # per-layer device tensors in transfer order (copies, safe after release)
    num_tokens: int


def state_specs(engine, num_tokens: int) -> list[StateTensorSpec]:
    """The tensors a request with `num_tokens` computed tokens exchanges, for this engine's model."""
    return request_state_specs(engine.cache, num_tokens, engine.model_config.hidden_size, engine.config.torch_dtype)


def export_state(engine, request: Request, into: dict[str, torch.Tensor] | None = None) -> ExportedState:
    """Gather a held request's state and release it. `into`: views of a staging buffer (from
    `transfer.state_layout.state_views`) to copy into, queued on the device, instead of fresh copies."""
    try:
        if request.last_hidden is None:
            raise RuntimeError(f"request {request.request_id} has no hidden state to export")
        num_tokens = request.num_computed_tokens
        specs = state_specs(engine, num_tokens)
        if into is not None:
            stage_request_state(engine.cache, request.page_ids, request.state_slot, num_tokens, request.last_hidden, into)
            # `into` may name only some tensors (the rest staged earlier): parts are what this call staged
            return ExportedState(specs, [into[spec.name] for spec in specs if spec.name in into], num_tokens)
        parts = [
            part for _, _, part in iter_request_state(
                engine.cache, request.page_ids, request.state_slot, num_tokens, request.last_hidden
            )
        ]
        return ExportedState(specs, parts, num_tokens)
    finally:
        engine.pool.release(request)


def reserve(engine, request: Request) -> None:
    """Give a new request pages and a slot for its whole prompt; raises CapacityError when the pool is short."""
    if not engine.pool.admit(request, NO_HIT, len(request.prompt_token_ids)):
        raise CapacityError(
            f"no free state slot or KV pages for {len(request.prompt_token_ids)} tokens now; retry or use another worker"
        )
    request.num_computed_tokens = 0
    request.admitted = True


def commit(engine, request: Request, tensors: dict[str, torch.Tensor], first_token: int, num_cached_tokens: int) -> None:
    """Install received state into the reservation; the request then decodes from `first_token`."""
    num_tokens = len(request.prompt_token_ids)
    write_request_state(engine.cache, request.page_ids, request.state_slot, num_tokens, tensors)
    request.num_computed_tokens = num_tokens
    request.num_cached_tokens = num_cached_tokens
    # a copy: the received tensors view a landing buffer that is reused once this commit is queued
    request.last_hidden = tensors["hidden"].to(engine.config.torch_device, copy=True)
    if engine.cache.hidden_states.shape[0] and request.state_slot is not None:  # the MTP drafter's carry
        engine.cache.hidden_states[request.state_slot] = request.last_hidden.to(engine.cache.hidden_states.dtype)
    request.output_token_ids.append(first_token)
    request.status = RequestStatus.RUNNING
