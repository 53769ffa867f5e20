"""The gRPC door's per-peer connection cap (router/grpc_connections.py): a peer's calls on up to
max_connections_per_peer busy connections run, a call on one more connection is refused with RESOURCE_EXHAUSTED
before it runs, more calls on a busy connection are fine, and a connection whose calls ended frees its place."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.channels import bind_port
from hybridserve.router.connection_guard import ConnectionLimits
from hybridserve.router.grpc_connections import PeerConnections, peer_host
from hybridserve.router.grpc_server import _handlers


def test_peer_identity_is_the_host_and_the_port_names_the_connection() -> None:
    assert peer_host("ipv4:10.0.0.1:5000") == ("10.0.0.1", "10.0.0.1:5000")
    assert peer_host("ipv6:[::1]:5000") == ("::1", "[::1]:5000")
    assert peer_host("unix:/tmp/s") == ("unix:/tmp/s", "unix:/tmp/s")
    connections = PeerConnections(ConnectionLimits(max_connections_per_peer=2))
    assert connections.enter("ipv4:10.0.0.1:1") and connections.enter("ipv4:10.0.0.1:2")
    assert connections.enter("ipv4:10.0.0.1:2")  # a second call on a busy connection
    assert not connections.enter("ipv4:10.0.0.1:3")  # a third connection of the host
    assert connections.enter("ipv4:10.0.0.2:3")  # another host
    connections.leave("ipv4:10.0.0.1:1")
    assert connections.busy("10.0.0.1") == 1 and connections.enter("ipv4:10.0.0.1:3")
    for peer in ("ipv4:10.0.0.1:2", "ipv4:10.0.0.1:2", "ipv4:10.0.0.1:3", "ipv4:10.0.0.2:3"):
        connections.leave(peer)
    assert connections.busy("10.0.0.1") == connections.busy("10.0.0.2") == 0


class _HangingRouter:
    """Stands in for RouterServicer: Generate answers once, then holds its call until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[router_pb2.GenerateResponse]:  # noqa: N802
        yield router_pb2.GenerateResponse(text_delta="x")
        await self.release.wait()

    async def Abort(self, request: Any, context: Any) -> common_pb2.AbortResponse:  # noqa: N802
        return common_pb2.AbortResponse()

    async def Health(self, request: Any, context: Any) -> common_pb2.HealthResponse:  # noqa: N802
        return common_pb2.HealthResponse(status="ok")


async def _cap_holds() -> None:
    servicer = _HangingRouter()
    connections = PeerConnections(ConnectionLimits(max_connections_per_peer=2))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(servicer, connections),))  # type: ignore[arg-type]
    port = bind_port(server, "127.0.0.1", 0)
    await server.start()
    # one connection per channel: no subchannel shared between them
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]
    stubs = [router_pb2_grpc.RouterStub(channel) for channel in channels]
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1]))
    try:
        held = [stubs[i].Generate(request, timeout=30) for i in (0, 1)]
        for call in held:
            assert (await call.read()).text_delta == "x"  # both connections busy
        again = stubs[0].Generate(request, timeout=30)  # one more call on a busy connection runs
        assert (await again.read()).text_delta == "x"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stubs[2].Health(common_pb2.HealthRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many connections from your address" in (refused.value.details() or "")
        assert connections.busy("127.0.0.1") == 2
        for call in (*held, again):
            call.cancel()
        for _ in range(100):  # the server sees the cancels
            if connections.busy("127.0.0.1") == 0:
                break
            await asyncio.sleep(0.05)
        assert (await stubs[2].Health(common_pb2.HealthRequest(), timeout=30)).status == "ok"
    finally:
        servicer.release.set()
        for channel in channels:
            await channel.close()
        await server.stop(None)


def test_a_peer_gets_its_cap_of_busy_connections_and_no_more() -> None:
    asyncio.run(_cap_holds())
