"""Authenticated internal gRPC: a shared secret token on every router -> worker and worker -> worker call.

Clients add it as metadata through a channel interceptor (`token_channel`); servers check it in a server
interceptor before any handler runs, with a constant-time comparison, and answer UNAUTHENTICATED otherwise, so
a refused call changes nothing. No token (None) is the insecure mode: every call is let through.
grpc's call credentials would need TLS channels; a metadata interceptor works on the plain ones too.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc

TOKEN_METADATA = "x-hybridserve-internal-token"


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the internal token to the metadata of every call made on the channel."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_METADATA, token)

    def _details(self, details: Any) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Callable, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Callable, client_call_details: Any,
                               request_iterator: Iterator[Any]) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Callable, client_call_details: Any,
                                request_iterator: Iterator[Any]) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def token_channel(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` sending `token` on every call (unchanged when token is None: insecure mode)."""
    return grpc.intercept_channel(channel, TokenClientInterceptor(token)) if token else channel


def token_matches(metadata: Any, token: str) -> bool:
    """Whether call metadata carries `token` (constant-time comparison)."""
    sent = dict(metadata or ()).get(TOKEN_METADATA)
    return isinstance(sent, str) and hmac.compare_digest(sent.encode(), token.encode())


class InternalTokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and before any handler runs, every call without the internal token."""

    def __init__(self, token: str) -> None:
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if token_matches(handler_call_details.invocation_metadata, self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]
