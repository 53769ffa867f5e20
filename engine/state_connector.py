"""The prefill/decode state handoff behind one object the engine calls at fixed points (as vLLM v1's KV connector).

The engine calls it when a request is added (`register`: a held request's `on_held` callback), when a step
finished requests (`request_finished`, then `step_finished`), when a request is aborted (`abort`) and to ask
whether a request id is taken (`owns`). The workers reach it through the engine's public methods:
a prefill worker exports a held request's state (`export_state`), a decode worker reserves pages and a slot for
a remote prefill (`reserve`) and installs the received state there (`commit`). Under tensor parallelism the
export and commit gather / scatter the shards (engine/tp_handoff.py); the bytes on the wire keep the unsharded
layout either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.common.outputs import RequestOutput
from hybridserve.engine import handoff, tp_handoff
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.spec_decode import SpecDecoder
from hybridserve.transfer.state_layout import StateTensorSpec


class ConnectorEngine(tp_handoff.TPEngine, Protocol):
    """The parts of `LLMEngine` its connector uses (a Protocol: the engine imports this module, not the reverse)."""

    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def spec(self) -> SpecDecoder | None: ...
    @property
    def lookahead(self) -> int: ...
    @property
    def tokenizer(self) -> Any: ...

    def admit_landed(self, request: Request) -> None: ...

    def finish_landed(self, request: Request, reason: str) -> None: ...


class StateConnector:
    """Held states (finished prefills waiting for their export) and reservations (decodes waiting for a state)."""

    def __init__(self, engine: ConnectorEngine) -> None:
        self.engine = engine
        self._held: dict[str, Request] = {}  # finished, state kept for export
        self._on_held: dict[str, Callable[[str], None]] = {}  # held requests' callbacks, until they finish
        self._finished: list[str] = []  # held in the current step, their callbacks still due
        self._reserved: dict[str, Request] = {}  # pages and slot waiting for a remote prefill's state

    # ---- called by the engine -------------------------------------------------------------------
    def register(self, request: Request, on_held: Callable[[str], None] | None) -> None:
        """A `hold_state` request was added; `on_held(request_id)` runs at the end of the step it finishes in."""
        if on_held is not None:
            self._on_held[request.request_id] = on_held

    def owns(self, request_id: str) -> bool:
        """Whether a held state or a reservation goes by this id."""
        return request_id in self._held or request_id in self._reserved

    def request_finished(self, request: Request) -> None:
        """A step finished `request`: a `hold_state` one keeps its pages and slot for `export_state`."""
        if request.hold_state:
            self._held[request.request_id] = request
            self._finished.append(request.request_id)

    def step_finished(self) -> None:
        """End of a step: the `on_held` callbacks of the requests it finished (e.g. to export the state right
        there: no extra trip to the loop, pages and slot free a step sooner)."""
        finished, self._finished = self._finished, []
        for request_id in finished:
            on_held = self._on_held.pop(request_id, None)
            if on_held is not None and request_id in self._held:
                on_held(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop the callback and free a held state or a reservation; False if neither went by this id."""
        self._on_held.pop(request_id, None)
        parked = self._held.pop(request_id, None) or self._reserved.pop(request_id, None)
        if parked is None:
            return False
        self.engine.pool.release(parked)
        return True

    # ---- called by the workers, through the engine ----------------------------------------------
    def state_specs(self, num_tokens: int) -> list[StateTensorSpec]:
        """The tensors a request with `num_tokens` computed tokens exchanges (the unsharded layout under TP)."""
        if self.engine.tp is not None:
            return tp_handoff.state_specs(self.engine, num_tokens)
        return handoff.state_specs(self.engine, num_tokens)

    def export_state(self, request_id: str, into: dict[str, torch.Tensor] | None = None) -> handoff.ExportedState:
        """Gather a held request's state (device copies, into `into`'s views when given) and release it."""
        request = self._held.pop(request_id, None)
        if request is None:
            raise ValueError(f"no held state for request {request_id!r}")
        if self.engine.tp is not None:
            return tp_handoff.export_state(self.engine, request, into)
        return handoff.export_state(self.engine, request, into)

    def reserve(self, request: Request) -> None:
        """Pages and a slot for a request whose prefill runs elsewhere; CapacityError when full now."""
        handoff.reserve(self.engine, request)
        self._reserved[request.request_id] = request

    def commit(self, request_id: str, tensors: dict[str, torch.Tensor], first_token: int,
               num_cached_tokens: int) -> RequestOutput:
        """Install the received state; the request joins the running batch (or finishes on its first token)."""
        engine = self.engine
        request = self._reserved.pop(request_id, None)
        if request is None:
            raise ValueError(f"no reservation for request {request_id!r} (aborted or expired)")
        (tp_handoff if engine.tp is not None else handoff).commit(engine, request, tensors, first_token,
                                                                  num_cached_tokens)
        if request.grammar is not None:  # the prefill worker sampled it under the same grammar
            request.grammar.accept_token(first_token)
        engine.admit_landed(request)
        reason = engine.scheduler.stop_reason(request, first_token)
        spec = engine.spec
        if reason is not None:
            engine.finish_landed(request, reason)
        elif spec is not None and engine.pool.reserve(request, request.num_tokens + engine.lookahead):
            spec.draft_landed(request)  # drafts for its first verify
        return request.output(engine.tokenizer)
