"""API keys on the front doors (vLLM's --api-key, several of them) and who a client is.

The HTTP API routes (/v1/*, /tokenize, /detokenize) need `Authorization: Bearer KEY`; health, readiness,
metrics and targets stay open for probes and scrapers; gRPC calls need the same value in their `authorization`
metadata, except server reflection (stock reflection clients cannot send metadata, and it only describes the
public service). Keys are compared in constant time.

A client's identity is the name of the key it sent (a key without a name: a hash of it) or, with no keys
configured, its peer address: aborts, request-id uniqueness and the per-client limit are keyed by it, so clients
with different keys are isolated even behind one address.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

PROTECTED_HTTP_PREFIX = "/v1"
PROTECTED_HTTP_PATHS = ("/tokenize", "/detokenize")  # vLLM's spelling of two /v1 routes
OPEN_GRPC_PREFIX = "/grpc.reflection."  # server reflection: no key (v1 and v1alpha)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@")


def protected(path: str) -> bool:
    """Whether an HTTP path needs the key (the API; not health, readiness, metrics or targets)."""
    return path.startswith(PROTECTED_HTTP_PREFIX) or path in PROTECTED_HTTP_PATHS


def parse_key(entry: str) -> tuple[str, str]:
    """(name, key) of a key entry "KEY" or "NAME=KEY" (a name: letters, digits, _ . - @); an unnamed key's name
    is 'key-' and the first 8 hex digits of its SHA-256 (never the key itself: names go to logs and metrics)."""
    name, sep, key = entry.strip().partition("=")
    if sep and name and key and set(name) <= _NAME_CHARS:
        return name, key
    key = entry.strip()
    if not key:
        raise ValueError("an API key must not be empty")
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8], key


@dataclass(frozen=True)
class ApiKeys:
    """The keys clients may send, each with a name (its client identity)."""

    keys: tuple[tuple[str, str], ...] = ()  # (name, key)

    def __post_init__(self) -> None:
        secrets = [k for _, k in self.keys]
        if len(set(secrets)) != len(secrets):
            raise ValueError("the same API key is given twice")

    @classmethod
    def load(cls, entries: str | Iterable[str] | None = None, key_file: str | Path | None = None) -> ApiKeys:
        """From --api-key values ("KEY" or "NAME=KEY", repeatable) and a key file (one entry a line; blank lines
        and lines starting with # skipped)."""
        listed = [entries] if isinstance(entries, str) else list(entries or ())
        if key_file is not None:
            try:
                lines = Path(key_file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"cannot read the API key file {key_file}: {exc.strerror}") from None
            listed += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return cls(tuple(parse_key(entry) for entry in listed))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the key an Authorization value ("Bearer KEY") carries; None for no or a wrong key. Every
        key is compared (constant time in which one matched)."""
        if authorization is None:
            return None
        sent = authorization.encode()
        found = None
        for name, key in self.keys:
            if hmac.compare_digest(sent, f"Bearer {key}".encode()):
                found = name
        return found

    def identity(self, authorization: str | None, address: str) -> str:
        """Who a request comes from: "key:NAME" with keys configured (a request without a valid key never gets
        this far), else "addr:" and the peer's address."""
        name = self.name_of(authorization) if self.keys else None
        return f"key:{name}" if name is not None else f"addr:{address}"


def authorized(header: str | None, keys: ApiKeys) -> bool:
    """Whether an Authorization header value carries one of the keys as a bearer token."""
    return keys.name_of(header) is not None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to any call without `authorization: Bearer KEY` but server reflection; for the
    router's grpc.aio server."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send metadata "
                                                                 "'authorization: Bearer <key>'")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(OPEN_GRPC_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if authorized(metadata.get("authorization"), self._keys):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
