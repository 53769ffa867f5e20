"""The gRPC front door: `hybridserve.v1.Router` (Generate, Abort, Health) with server reflection on.

Generate streams token ids and text deltas; the first response carries the client's request id, the last the
finish reason and a usage summary. It runs the HTTP door's checks (router/request_checks.py) and admission
control; a client that cancels aborts the request. Requests arrive as bytes and are parsed here, so that a
malformed message is answered INVALID_ARGUMENT (grpc's own deserializer failure would be UNKNOWN).

A client is its identity (router/auth.py: its API key's name, or its peer address without keys). Internal
request ids are always the router's own uuids: a client's `request_id` is a label, unique among that client's
requests in flight (ALREADY_EXISTS otherwise), echoed back, and usable in Abort by the same client only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_reflection.v1alpha import reflection

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.proto import common_pb2, router_pb2
from hybridserve.proto.channels import OWN_PORT, bind_port
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.router.admission import Overloaded
from hybridserve.router.auth import ApiKeyInterceptor, ApiKeys
from hybridserve.router.connection_guard import ConnectionLimits
from hybridserve.router.frontend import GRPC_TO_HTTP, Frontend
from hybridserve.router.grpc_connections import PeerConnections
from hybridserve.router.openai_protocol import ApiError
from hybridserve.router.orchestrator import WorkerError
from hybridserve.router.request_checks import check_request_id, check_sampling

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
SERVICE = "hybridserve.v1.Router"
_HTTP_TO_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 409: grpc.StatusCode.ALREADY_EXISTS, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}


def peer_address(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str:
    """The caller's host without its port, e.g. ipv4:10.0.0.1 (one client's connections count together)."""
    return context.peer().rsplit(":", 1)[0]


class CallerRequests:
    """(client identity, the id the client knows) -> the router's internal id of that request in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str], str] = {}

    def add(self, owner: tuple[str, str], internal_id: str) -> bool:
        """False when the client has a request of that id in flight already."""
        with self._lock:
            if owner in self._ids:
                return False
            self._ids[owner] = internal_id
            return True

    def remove(self, owner: tuple[str, str], internal_id: str) -> None:
        with self._lock:
            if self._ids.get(owner) == internal_id:
                del self._ids[owner]

    def of(self, owner: tuple[str, str]) -> str | None:
        with self._lock:
            return self._ids.get(owner)


class RouterServicer:
    """The Router service as grpc.aio handlers on the router's event loop (the orchestrator's)."""

    def __init__(self, frontend: Frontend, keys: ApiKeys | None = None) -> None:
        self.frontend = frontend
        self.keys = keys or ApiKeys()
        self.requests = CallerRequests()
        # clients repeat their sampling settings: parse and check each distinct one (by its wire bytes, which
        # say whether the optional fields are set) once; SamplingParams is frozen, so requests can share it (a
        # refused one raises again: errors are not cached)
        self._sampling = functools.lru_cache(maxsize=256)(self._parse_sampling)

    def identity(self, context: grpc.aio.ServicerContext) -> str:
        key = dict(context.invocation_metadata() or ()).get("authorization")
        return self.keys.identity(key if isinstance(key, str) else None, peer_address(context))

    def _parse_sampling(self, raw: bytes) -> SamplingParams:
        options = common_pb2.SamplingOptions.FromString(raw)
        params = sampling_from_proto(options)
        # the sampling fields the proto can leave unset take the checkpoint's defaults; the others are always
        # explicit on gRPC
        unset = {name: value for name in ("repetition_penalty", "no_repeat_ngram_size")
                 if not options.HasField(name) and (value := self.frontend.generation_defaults.get(name)) is not None}
        params = dataclasses.replace(params, **unset) if unset else params
        check_sampling(params)
        return params

    def _checked(self, request: router_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the sampling parameters, by the HTTP door's rules; ApiError."""
        if request.request_id:
            check_request_id(request.request_id)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ApiError(400, "a request needs a prompt: text or token_ids", param="prompt")
        try:
            params = self._sampling(request.sampling.SerializeToString(deterministic=True))
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        ids = self.frontend.encode(request.text if kind == "text" else list(request.token_ids.ids))
        self.frontend.max_tokens_for(ids, params.max_tokens)
        return ids, params

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext  # noqa: N802
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        metrics = self.frontend.metrics
        admission = self.frontend.admission
        try:
            prompt, params = self._checked(request)
            text = TextStream(self.frontend.tokenizer, params.stop, params.include_stop_str_in_output)
        except (ApiError, ValueError) as exc:
            code, message = (exc.status, exc.message) if isinstance(exc, ApiError) else (400, str(exc))
            metrics.count_request("grpc/Generate", str(code))
            await context.abort(_HTTP_TO_GRPC.get(code, grpc.StatusCode.INVALID_ARGUMENT), message)
        client = self.identity(context)
        request_id = uuid.uuid4().hex  # never the client's: two clients may send the same label
        label = request.request_id or request_id
        owner = (client, label)
        if not self.requests.add(owner, request_id):
            metrics.count_request("grpc/Generate", "409")
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {label!r} is already in flight")
        try:
            if not admission.try_acquire(client):  # wait in line on the loop; a cancelled call leaves it
                await admission.acquire_async(client)
        except Overloaded as exc:
            self.requests.remove(owner, request_id)
            metrics.count_request("grpc/Generate", "429")
            metrics.count_error("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BaseException:  # cancelled while waiting in line: the id is free again
            self.requests.remove(owner, request_id)
            raise
        events = self.frontend.orchestrator.stream(prompt, params, request_id)
        status = "499"  # unless the stream ends or fails: the client went away
        completion = 0
        try:
            # a client that cancels cancels this task: the stream unwinds and aborts its workers
            async for event in events:
                delta = text.add(event.token_ids)
                completion += len(event.token_ids)
                response = router_pb2.GenerateResponse(event=event, text_delta=delta)
                if event.finish_reason:
                    response.text_delta += text.finish()
                    response.usage.CopyFrom(router_pb2.Usage(
                        prompt_tokens=len(prompt), completion_tokens=completion,
                        total_tokens=len(prompt) + completion, cached_tokens=event.num_cached_tokens))
                if label:  # the id once, on the first response
                    response.event.request_id = label
                    label = ""
                else:
                    response.event.ClearField("request_id")
                yield response
            status = "200"
        except WorkerError as exc:
            http_status = GRPC_TO_HTTP.get(exc.code, (500,))[0]
            status = str(http_status)
            metrics.count_error("cancelled" if exc.code == grpc.StatusCode.CANCELLED else "unavailable"
                                if exc.code == grpc.StatusCode.UNAVAILABLE else "internal")
            if http_status >= 500:
                logger.warning("request %s failed on the workers (%s): %s", request_id, exc.code.name, exc)
            await context.abort(exc.code, exc.public)
        finally:
            metrics.count_request("grpc/Generate", status)
            await events.aclose()
            self.requests.remove(owner, request_id)
            admission.release(client)

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext  # noqa: N802
                    ) -> common_pb2.AbortResponse:
        """Aborts the caller's own request of that id (label); another client's is not found."""
        internal_id = self.requests.of((self.identity(context), request.request_id))
        return common_pb2.AbortResponse(found=internal_id is not None
                                        and bool(self.frontend.orchestrator.abort(internal_id)))

    async def Health(self, request: common_pb2.HealthRequest, context: grpc.aio.ServicerContext  # noqa: N802
                     ) -> common_pb2.HealthResponse:
        orchestrator = self.frontend.orchestrator
        prefill, decode = orchestrator.workers.snapshot()
        ready = any(h.health is not None for h in decode)
        return common_pb2.HealthResponse(
            status="ok" if ready else "not_ready", role="router", num_running=self.frontend.admission.running,
            num_waiting=self.frontend.admission.queued, max_model_len=self.frontend.max_model_len,
            block_size=orchestrator.workers.block_size() or 0,
        )


async def _parsed(cls: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name} message: {exc}")
        raise  # abort raises; this line is for type checkers


async def _refuse_connection(context: grpc.aio.ServicerContext, connections: PeerConnections) -> None:
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"too many connections from your address are busy (at most "
                        f"{connections.limits.max_connections_per_peer}): run more calls on fewer channels")


def _handlers(servicer: RouterServicer, connections: PeerConnections) -> grpc.GenericRpcHandler:
    """The Router service's handlers, taking raw bytes (parsed by `_parsed`); a call runs only when its
    connection is within its peer's connection cap."""

    def unary(cls: type[M], method: Callable[[M, Any], Awaitable[Message]]) -> grpc.RpcMethodHandler:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
            peer = context.peer()
            if not connections.enter(peer):
                await _refuse_connection(context, connections)
            try:
                return await method(await _parsed(cls, raw, context), context)
            finally:
                connections.leave(peer)

        return grpc.unary_unary_rpc_method_handler(handle, response_serializer=lambda m: m.SerializeToString())

    async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        peer = context.peer()
        if not connections.enter(peer):
            await _refuse_connection(context, connections)
        try:
            async for response in servicer.Generate(await _parsed(router_pb2.GenerateRequest, raw, context), context):
                yield response
        finally:
            connections.leave(peer)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(generate, response_serializer=lambda m: m.SerializeToString()),
        "Abort": unary(common_pb2.AbortRequest, servicer.Abort),
        "Health": unary(common_pb2.HealthRequest, servicer.Health),
    })


async def start_router_server(frontend: Frontend, host: str = "127.0.0.1", port: int = 0,
                              api_keys: ApiKeys | str | None = None, handshake_timeout_s: float = 10.0,
                              idle_timeout_s: float = 300.0,
                              limits: ConnectionLimits | None = None) -> tuple[grpc.aio.Server, str]:
    """Start the gRPC front door, a grpc.aio server on the running loop (the orchestrator's), with reflection
    (open: it describes only the public service); every other call needs one of `api_keys` when given. A
    connection that does not finish its HTTP/2 handshake within `handshake_timeout_s`, or runs no call for
    `idle_timeout_s`, is closed (gRPC core's own options); `limits` caps open connections in all (core closes
    more) and busy ones per peer (router/grpc_connections.py). Returns (server, "host:port")."""
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys.load(api_keys)
    limits = limits or ConnectionLimits()
    interceptors = [ApiKeyInterceptor(keys)] if keys else []
    options = [OWN_PORT, ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
               ("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)),
               ("grpc.max_allowed_incoming_connections", limits.max_connections)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    connections = PeerConnections(limits, frontend.metrics)
    server.add_generic_rpc_handlers((_handlers(RouterServicer(frontend, keys), connections),))
    names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = bind_port(server, host, port)
    await server.start()
    return server, f"{host}:{bound}"
