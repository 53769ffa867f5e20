"""Channels between components (proto/channels.py): a peer restarted on the same host:port is reached by a new
channel at once, although a channel to the dead peer is still open (gRPC's process-wide subchannel pool would
hand the new channel the old one's reconnect backoff: "Connection refused" without a connection attempt)."""

from __future__ import annotations

import grpc
import pytest

from hybridserve.proto.channels import channel_options, internal_channel, start_server


def _echo_server(port: int) -> tuple[grpc.Server, int]:
    handler = grpc.method_handlers_generic_handler(
        "t.Echo", {"Call": grpc.unary_unary_rpc_method_handler(lambda request, context: request)})
    return start_server("127.0.0.1", port, lambda s: s.add_generic_rpc_handlers((handler,)), max_workers=4)


def _call(channel: grpc.Channel, payload: bytes) -> bytes:
    return channel.unary_unary("/t.Echo/Call")(payload, timeout=10)


def test_a_new_channel_reaches_a_peer_restarted_on_the_same_port() -> None:
    first, port = _echo_server(0)
    stale = internal_channel(f"127.0.0.1:{port}", None)
    try:
        assert _call(stale, b"a") == b"a"
        first.stop(0).wait()
        with pytest.raises(grpc.RpcError) as gone:  # the stale channel now sits in reconnect backoff
            _call(stale, b"b")
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        second, again = _echo_server(port)
        try:
            assert again == port
            fresh = internal_channel(f"127.0.0.1:{port}", None)
            assert _call(fresh, b"c") == b"c"
            fresh.close()
        finally:
            second.stop(0)
    finally:
        stale.close()


def test_channel_options_keep_the_message_limits_and_add_extras() -> None:
    options = dict(channel_options(("grpc.channel_id", 3)))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] >= 64 << 20
    assert options["grpc.use_local_subchannel_pool"] == 1 and options["grpc.channel_id"] == 3
    assert 0 < options["grpc.max_reconnect_backoff_ms"] <= 5000


def test_a_taken_port_is_refused_not_shared() -> None:
    """Without SO_REUSEPORT a second server on a port ours already holds fails to bind (a clear error) instead of
    splitting the first one's connections with it."""
    first, port = _echo_server(0)
    try:
        with pytest.raises(RuntimeError, match="could not bind"):
            _echo_server(port)
        channel = internal_channel(f"127.0.0.1:{port}", None)
        assert all(_call(channel, bytes([i])) == bytes([i]) for i in range(20))  # every call reaches the first
        channel.close()
    finally:
        first.stop(0)
