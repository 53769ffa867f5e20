"""gRPC channel and server settings shared by every component: one place for the message limits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc

from hybridserve.proto.internal_auth import InternalTokenInterceptor, token_channel
from hybridserve.proto.internal_tls import InternalTlsConfig

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # state chunks are 1 MiB by default; room for larger ones where faster
MAX_RECONNECT_BACKOFF_MS = 2000  # a restarted peer is reached within ~2 s (gRPC's default cap is 120 s)


def message_options(*extra: tuple[str, int | str]) -> list[tuple[str, int | str]]:
    """Channel / server options with the raised message limits (plus any extra ones)."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *extra,
    ]


# No SO_REUSEPORT on our servers (gRPC sets it by default on Linux). With it two servers can hold one port and the
# kernel splits connections between them: a server bound to port 0 can be handed a port another of ours already
# listens on (grpc/grpc#10755: a router's Prefill call then lands on a decode worker, "Method not found"), and a
# worker started on a taken port shares it silently instead of failing to bind.
OWN_PORT: tuple[str, int] = ("grpc.so_reuseport", 0)


def server_options() -> list[tuple[str, int | str]]:
    """Options of a worker's gRPC server: the message limits, its port its own."""
    return message_options(OWN_PORT)


def channel_options(*extra: tuple[str, int | str]) -> list[tuple[str, int | str]]:
    """Options of every channel to another component: the message limits, connections of the channel's own
    (gRPC otherwise shares subchannels process-wide by address and arguments, so a channel left to a peer that
    died keeps one in reconnect backoff, and a fresh channel to a new peer bound to the same host:port fails at
    once with "Connection refused" until that backoff ends), and a short reconnect backoff cap."""
    return message_options(("grpc.use_local_subchannel_pool", 1),
                           ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS), *extra)


def insecure_channel(address: str, *extra: tuple[str, int | str]) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options(*extra))


def internal_channel(address: str, token: str | None, *extra: tuple[str, int | str],
                     tls: InternalTlsConfig | None = None) -> grpc.Channel:
    """A channel to another component that sends the internal token on every call (None: insecure mode), over
    mutual TLS when `tls` is enabled (plaintext otherwise)."""
    if tls is not None and tls.enabled:
        channel = grpc.secure_channel(address, tls.channel_credentials(),
                                      options=channel_options(*extra, *tls.channel_options()))
    else:
        channel = insecure_channel(address, *extra)
    return token_channel(channel, token)


def worker_threads(max_num_seqs: int) -> int:
    """gRPC handler threads of a worker. A request holds its token stream for its whole life and its state
    push runs on up to 4 striped streams besides; a pool smaller than that deadlocks under load (the token
    streams wait for pushes that never get a thread), so size it well past max_num_seqs (idle threads cost
    little) and past the router's default of in-flight requests (256, each with a token stream) plus their
    pushes, health polls and the cache-event subscription: calls past the pool are refused (RESOURCE_EXHAUSTED),
    so the pool is also the bound on queued calls. Threads are made on demand."""
    return max(512, 8 * max_num_seqs)


def bind_port(server: grpc.Server | grpc.aio.Server, host: str, port: int,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Add the listening port (TLS when `credentials` are given); returns the bound port, or raises a clear error
    when it cannot be bound (grpcio returns 0 or raises, by version)."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"could not bind a gRPC server to {address} (is the port taken?): {exc}") from exc
    if bound == 0:
        raise RuntimeError(f"could not bind a gRPC server to {address} (is the port taken?)")
    return bound


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def start_server(host: str, port: int, register: Callable[[grpc.Server], None], max_workers: int = 32,
                 token: str | None = None, tls: InternalTlsConfig | None = None) -> tuple[grpc.Server, int]:
    """Start a gRPC server with the shared limits; `register` adds the servicers; every call must carry
    `token` (None: insecure mode, logged); with `tls` enabled every connection must present a client
    certificate of the same CA (mutual TLS; plaintext otherwise, logged). Returns (server, bound port)."""
    interceptors = [InternalTokenInterceptor(token)] if token else []
    # maximum_concurrent_rpcs: a call past the handler pool is refused at once (RESOURCE_EXHAUSTED) instead of
    # queueing in the executor without bound
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=server_options(),
                         interceptors=interceptors, maximum_concurrent_rpcs=max_workers)
    register(server)
    secure = tls is not None and tls.enabled
    bound = bind_port(server, host, port, tls.server_credentials() if tls is not None and secure else None)
    server.start()
    if not is_loopback(host) and not (token and secure):  # one line; on loopback only this host reaches it
        missing = " and ".join(what for what, on in (("no internal token", token), ("no internal TLS", secure)) if not on)
        logger.warning("gRPC server on %s:%d (%s): any process that reaches it can %s; set --internal-token and "
                       "--internal-tls-ca-file/-cert-file/-key-file beyond a trusted host", host, bound, missing,
                       "call it" if not token else "read its traffic")
    return server, bound
