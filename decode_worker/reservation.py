"""`Reservation`: what a decode worker holds for a request between Reserve and its state's commit: pages and a
state slot in the engine, the ticket the prefill side names, and the output stream a session or StreamTokens
takes over."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.transfer.grpc_receiver import StateAssembly
from hybridserve.worker_runtime.engine_loop import RedirectableStream


@dataclass
class Reservation:
    """A decode worker's hold on one request's room until its state arrives and commits."""

    ticket: str
    request_id: str
    num_tokens: int
    deadline: float
    stream: RedirectableStream = field(repr=False)  # its outputs: read by StreamTokens, or handed to a session
    committed: bool = False
    assembly: StateAssembly | None = field(default=None, repr=False)
