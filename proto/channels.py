"""gRPC channel and server settings shared by every component: one place for the message limits."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

MAX_MESSAGE_BYTES = 64 << 20  # state chunks are 1 MiB by default; room for larger ones where faster


def message_options(*extra: tuple[str, int]) -> list[tuple[str, int]]:
    """Channel / server options with the raised message limits (plus any extra ones)."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *extra,
    ]


def insecure_channel(address: str, *extra: tuple[str, int]) -> grpc.Channel:
    return grpc.insecure_channel(address, options=message_options(*extra))


def worker_threads(max_num_seqs: int) -> int:
    """gRPC handler threads of a worker. A request holds its token stream for its whole life and its state
    push runs on up to 4 striped streams besides; a pool smaller than that deadlocks under load (the token
    streams wait for pushes that never get a thread), so size it well past max_num_seqs (idle threads cost
    little) and at least the router's default of in-flight requests."""
    return max(256, 8 * max_num_seqs)


def start_server(host: str, port: int, register: Callable[[grpc.Server], None], max_workers: int = 32) -> tuple[grpc.Server, int]:
    """Start a gRPC server with the shared limits; `register` adds the servicers. Returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=message_options())
    register(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
