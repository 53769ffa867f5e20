"""Connection limits on the gRPC door, with the HTTP door's limits (`ConnectionLimits`) and peer identity (the
client's host address, without its port).

gRPC core caps open connections in all (`grpc.max_allowed_incoming_connections`: past it, it closes new ones)
but has no per-peer cap and shows a handler no connection events, only each call's peer (host and port, the
port naming the connection). So the per-peer cap counts, for each host, the connections that have a call in
flight: a call on a new connection from a host that already has `max_connections_per_peer` busy ones is refused
with RESOURCE_EXHAUSTED before it runs. Idle connections are closed by core after the door's idle timeout, and
a connection that never finishes its handshake after the handshake timeout, so they hold no more than that.
"""

from __future__ import annotations

import collections
import logging

from hybridserve.router.connection_guard import ConnectionLimits
from hybridserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


def peer_host(peer: str) -> tuple[str, str]:
    """(host, connection) of a gRPC peer string: "ipv4:10.0.0.1:5000" -> ("10.0.0.1", "10.0.0.1:5000"),
    "ipv6:[::1]:5000" -> ("::1", "[::1]:5000"); a Unix socket peer is its own host."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in address:
        return peer, peer
    host = address.rsplit(":", 1)[0]
    return host.strip("[]"), address


class PeerConnections:
    """Busy connections per peer host on the gRPC door (the router's event loop touches it, one thread)."""

    def __init__(self, limits: ConnectionLimits, metrics: RouterMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self._calls: dict[str, collections.Counter[str]] = {}  # host -> connection -> calls in flight

    def enter(self, peer: str) -> bool:
        """A call starts on `peer`'s connection: False (and nothing counted) when it would be one connection too
        many for its host."""
        host, connection = peer_host(peer)
        busy = self._calls.setdefault(host, collections.Counter())
        if connection not in busy and len(busy) >= self.limits.max_connections_per_peer:
            if not busy:
                del self._calls[host]
            logger.info("refusing a gRPC call from %s: %d of its connections are busy", peer, len(busy))
            if self.metrics is not None:
                self.metrics.count_error("connection_limit")
            return False
        busy[connection] += 1
        return True

    def leave(self, peer: str) -> None:
        """The call `enter` admitted on `peer`'s connection ended."""
        host, connection = peer_host(peer)
        busy = self._calls.get(host)
        if busy is None or connection not in busy:
            return
        busy[connection] -= 1
        if busy[connection] <= 0:
            del busy[connection]
        if not busy:
            del self._calls[host]

    def busy(self, host: str) -> int:
        """Connections of `host` with a call in flight."""
        return len(self._calls.get(host, ()))
