"""`Reservation`: what a decode worker holds for a request between Reserve and its state's commit: pages and a
state slot in the engine, the ticket the prefill side names, and the output stream a session or StreamTokens
takes over. `ReservationBook`: a worker's reservations by ticket, from Reserve until a reader claims the stream."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from hybridserve.transfer.grpc_receiver import StateAssembly
from hybridserve.transfer.manifest import TransferError
from hybridserve.worker_runtime.engine_loop import RedirectableStream

CANCELLED_KEPT = 1024  # causes of recently cancelled reservations kept for their late streams


@dataclass
class Reservation:
    """A decode worker's hold on one request's room until its state arrives and commits."""

    ticket: str
    request_id: str
    num_tokens: int
    deadline: float  # monotonic: the state must land by then (after commit: a reader must claim the stream)
    stream: RedirectableStream = field(repr=False)  # its outputs: read by StreamTokens, or handed to a session
    ttl_s: float = 60.0  # how long it waits for its state, and after the commit for its reader
    committed: bool = False
    claimed: bool = False  # a StreamTokens call or a session took its token stream
    assembly: StateAssembly | None = field(default=None, repr=False)


class ReservationBook:
    """Reservations by ticket: open (state not committed yet), committed but unclaimed (the state can land
    before the router's stream call arrives: the request runs and queues its output until its reader comes),
    and why recent ones were cancelled (a state's other streams, or a late reader, get that cause rather than
    "unknown ticket"; bounded: oldest dropped). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Reservation] = {}
        self._unclaimed: dict[str, Reservation] = {}
        self._cancelled: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._open or self._unclaimed)

    def add(self, reservation: Reservation) -> None:
        with self._lock:
            self._open[reservation.ticket] = reservation

    def _missing(self, ticket: str) -> TransferError:
        cause = self._cancelled.get(ticket)
        if cause is not None:
            return TransferError("FAILED_PRECONDITION", f"the reservation of ticket {ticket!r} was cancelled: {cause}")
        return TransferError("FAILED_PRECONDITION", f"unknown or expired ticket {ticket!r}")

    def for_state(self, ticket: str) -> Reservation:
        """The open reservation a state stream names; TransferError when there is none."""
        with self._lock:
            reservation = self._open.get(ticket)
            if reservation is None:
                raise self._missing(ticket)
            return reservation

    def is_open(self, reservation: Reservation) -> bool:
        with self._lock:
            return self._open.get(reservation.ticket) is reservation

    def claim(self, ticket: str, request_id: str) -> Reservation:
        """A reader takes the reservation's token stream, before or after its commit."""
        with self._lock:
            reservation = self._open.get(ticket) or self._unclaimed.get(ticket)
            if reservation is None:
                raise self._missing(ticket)
            if reservation.request_id != request_id:
                raise TransferError("INVALID_ARGUMENT", "ticket and request_id do not match")
            if reservation.claimed:
                raise TransferError("ALREADY_EXISTS", f"the token stream of {request_id!r} is already being read")
            reservation.claimed = True
            self._unclaimed.pop(ticket, None)  # committed before this claim: done here
            return reservation

    def settle(self, reservation: Reservation) -> None:
        """After its commit: the reservation leaves the open ones; unless its reader has it already, it waits for
        one until `ttl_s` from now."""
        with self._lock:
            reservation.committed = True
            if self._open.pop(reservation.ticket, None) is not None and not reservation.claimed:
                reservation.deadline = time.monotonic() + reservation.ttl_s
                self._unclaimed[reservation.ticket] = reservation

    def cancel(self, reservation: Reservation, cause: str) -> bool:
        """Remove an open or unclaimed reservation, keeping its cause; False when it was not there."""
        with self._lock:
            if (self._open.pop(reservation.ticket, None) or self._unclaimed.pop(reservation.ticket, None)) is None:
                return False
            self._cancelled[reservation.ticket] = cause
            while len(self._cancelled) > CANCELLED_KEPT:
                self._cancelled.popitem(last=False)
            return True

    def find(self, request_id: str) -> Reservation | None:
        """The open or unclaimed reservation of a request id."""
        with self._lock:
            return next((r for r in (*self._open.values(), *self._unclaimed.values()) if r.request_id == request_id),
                        None)

    def expired(self, now: float) -> list[Reservation]:
        """Open ones whose state did not come, and committed ones no reader claimed, past their deadline."""
        with self._lock:
            return [r for r in (*self._open.values(), *self._unclaimed.values()) if r.deadline < now]
