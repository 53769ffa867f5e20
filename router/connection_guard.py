"""Connection limits on the HTTP door: a first-byte and a header timeout, and caps on open connections in total
and per peer address.

Hand-written because uvicorn has none of these: its `timeout_keep_alive` only runs between requests, and
`limit_concurrency` answers 503 once a request is parsed, so a client that opens connections and sends nothing,
or sends headers a byte at a time (slowloris), holds them forever. The guard is uvicorn's own httptools protocol
with timers and counters added at the transport level, where a connection is visible before any request is.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from hybridserve.router.config import RouterOptions
    from hybridserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    first_byte_timeout_s: float = 10.0  # an open connection sends its first byte within this
    header_timeout_s: float = 10.0  # a request's headers are complete within this of its first byte
    max_connections: int = 4096  # open connections in all
    max_connections_per_peer: int = 256  # open connections from one address

    @classmethod
    def of(cls, options: RouterOptions) -> ConnectionLimits:
        return cls(options.first_byte_timeout_s, options.header_timeout_s, options.max_connections,
                   options.max_connections_per_peer)


class _Open:
    """Open connections, in total and per peer address (one per server: the loop's thread only touches it)."""

    def __init__(self) -> None:
        self.total = 0
        self.per_peer: collections.Counter[str] = collections.Counter()


def guarded_protocol(limits: ConnectionLimits, metrics: RouterMetrics | None = None) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class (uvicorn.Config(http=...)) enforcing `limits`."""
    open_ = _Open()

    class GuardedHttpProtocol(HttpToolsProtocol):
        _guard_timer: asyncio.TimerHandle | None = None
        _peer: str | None = None
        _waiting_first_byte = False

        def _closed_by_guard(self, why: str) -> None:
            logger.info("closing HTTP connection from %s: %s", self._peer, why)
            if metrics is not None:
                metrics.count_error(why.split(" ", 1)[0])
            self.transport.close()

        def _arm(self, seconds: float, why: str) -> None:
            self._disarm()
            self._guard_timer = self.loop.call_later(seconds, self._closed_by_guard, why)

        def _disarm(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else "?"
            if open_.total >= limits.max_connections or open_.per_peer[peer] >= limits.max_connections_per_peer:
                logger.info("refusing an HTTP connection from %s: %d open in all, %d from it", peer, open_.total,
                            open_.per_peer[peer])
                if metrics is not None:
                    metrics.count_error("connection_limit")
                transport.close()
                return
            self._peer = peer
            open_.total += 1
            open_.per_peer[peer] += 1
            self._waiting_first_byte = True
            self._arm(limits.first_byte_timeout_s, f"first_byte_timeout: no byte in {limits.first_byte_timeout_s:g} s")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._peer is not None:
                open_.total -= 1
                open_.per_peer[self._peer] -= 1
                if open_.per_peer[self._peer] <= 0:
                    del open_.per_peer[self._peer]
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_first_byte:  # the header clock starts with the first byte
                self._waiting_first_byte = False
                self._arm(limits.header_timeout_s, f"header_timeout: headers not complete in {limits.header_timeout_s:g} s")
            super().data_received(data)

        def on_message_begin(self) -> None:  # a later request on a kept-alive connection: its headers are timed too
            super().on_message_begin()
            if self._guard_timer is None:
                self._arm(limits.header_timeout_s, f"header_timeout: headers not complete in {limits.header_timeout_s:g} s")

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

    return GuardedHttpProtocol
