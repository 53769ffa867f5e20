"""An optional API key on the front doors (vLLM's --api-key): the HTTP API routes (/v1/*, /tokenize,
/detokenize) need `Authorization: Bearer KEY`; health, readiness, metrics and targets stay open for probes and
scrapers; gRPC calls need the same value in their `authorization` metadata. Keys are compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

PROTECTED_HTTP_PREFIX = "/v1"
PROTECTED_HTTP_PATHS = ("/tokenize", "/detokenize")  # vLLM's spelling of two /v1 routes


def protected(path: str) -> bool:
    """Whether an HTTP path needs the key (the API; not health, readiness, metrics or targets)."""
    return path.startswith(PROTECTED_HTTP_PREFIX) or path in PROTECTED_HTTP_PATHS


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header value carries the key as a bearer token."""
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {api_key}".encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to any call without `authorization: Bearer KEY` (reflection included); for the
    router's grpc.aio server."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send metadata "
                                                                 "'authorization: Bearer <key>'")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any) -> Any:
        metadata = dict(handler_call_details.invocation_metadata or ())
        if authorized(metadata.get("authorization"), self._api_key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
