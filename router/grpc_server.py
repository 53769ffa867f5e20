"""The gRPC front door: `hybridserve.v1.Router` (Generate, Abort, Health) with server reflection on.

Generate streams token ids, text deltas, the finish reason and usage (on the last event). It shares the
frontend's checks and admission control with the HTTP door; a client that cancels aborts the request.
Internal request ids are always the router's own uuids: a client's `request_id` is a label, echoed back in its
events and usable in Abort by the same caller only (the same API key, or the same connection without one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_reflection.v1alpha import reflection

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.channels import OWN_PORT, bind_port
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.router.admission import Overloaded, client_key
from hybridserve.router.auth import ApiKeyInterceptor
from hybridserve.router.frontend import Frontend
from hybridserve.router.openai_protocol import ApiError
from hybridserve.router.orchestrator import WorkerError

logger = logging.getLogger(__name__)

_HTTP_TO_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}


def caller(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str:
    """Who is calling: their API key (hashed; a key is one client) or, without one, their connection."""
    key = dict(context.invocation_metadata() or ()).get("authorization")
    return client_key(key if isinstance(key, str) else None, context.peer())


def caller_address(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str:
    """The caller's host (the per-client limit counts a host's connections together), e.g. ipv4:10.0.0.1."""
    return context.peer().rsplit(":", 1)[0]


class CallerRequests:
    """(caller, the id the caller knows) -> the router's internal ids of that caller's requests in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str], set[str]] = {}

    def add(self, owner: tuple[str, str], internal_id: str) -> None:
        with self._lock:
            self._ids.setdefault(owner, set()).add(internal_id)

    def remove(self, owner: tuple[str, str], internal_id: str) -> None:
        with self._lock:
            ids = self._ids.get(owner)
            if ids is not None:
                ids.discard(internal_id)
                if not ids:
                    del self._ids[owner]

    def of(self, owner: tuple[str, str]) -> list[str]:
        with self._lock:
            return list(self._ids.get(owner, ()))


class RouterServicer(router_pb2_grpc.RouterServicer):
    """The Router service as grpc.aio handlers on the router's event loop (the orchestrator's)."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.requests = CallerRequests()
        # clients repeat their sampling settings: parse and check each distinct one (by its wire bytes, which
        # say whether the optional fields are set) once; SamplingParams is frozen, so requests can share it (a
        # refused one raises again: errors are not cached)
        self._sampling = functools.lru_cache(maxsize=256)(self._parse_sampling)

    def _parse_sampling(self, raw: bytes) -> SamplingParams:
        options = common_pb2.SamplingOptions.FromString(raw)
        params = sampling_from_proto(options)
        # the sampling fields the proto can leave unset take the checkpoint's defaults; the others are always
        # explicit on gRPC
        unset = {name: value for name in ("repetition_penalty", "no_repeat_ngram_size")
                 if not options.HasField(name) and (value := self.frontend.generation_defaults.get(name)) is not None}
        return dataclasses.replace(params, **unset) if unset else params

    async def _prompt(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a request needs a prompt: text or token_ids")
        prompt = request.text if kind == "text" else list(request.token_ids.ids)
        try:
            ids = self.frontend.encode(prompt)
            if request.sampling.max_tokens:
                self.frontend.max_tokens_for(ids, int(request.sampling.max_tokens))
        except ApiError as exc:
            await context.abort(_HTTP_TO_GRPC.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), exc.message)
        return ids

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext  # noqa: N802
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        metrics = self.frontend.metrics
        admission = self.frontend.admission
        prompt = await self._prompt(request, context)
        try:
            params = self._sampling(request.sampling.SerializeToString(deterministic=True))
            text = TextStream(self.frontend.tokenizer, params.stop, params.include_stop_str_in_output)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        key = dict(context.invocation_metadata() or ()).get("authorization")
        key = key if isinstance(key, str) else None
        peer = context.peer()  # caller() and caller_address() of this context, from one metadata and peer read
        client = client_key(key, peer.rsplit(":", 1)[0])
        try:
            if not admission.try_acquire(client):  # wait in line on the loop; a cancelled call leaves it
                await admission.acquire_async(client)
        except Overloaded as exc:
            metrics.count_request("grpc/Generate", "429")
            metrics.count_error("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        request_id = uuid.uuid4().hex  # never the client's: two clients may send the same label
        label = request.request_id or request_id
        owner = (client_key(key, peer), label)
        self.requests.add(owner, request_id)
        events = self.frontend.orchestrator.stream(prompt, params, request_id)
        try:
            # a client that cancels cancels this task: the stream unwinds and aborts its workers
            async for event in events:
                delta = text.add(event.token_ids)
                if event.finish_reason:
                    delta += text.finish()
                event.request_id = label
                yield router_pb2.GenerateResponse(event=event, text_delta=delta)
            metrics.count_request("grpc/Generate", "200")
        except WorkerError as exc:
            metrics.count_request("grpc/Generate", "error")
            metrics.count_error("cancelled" if exc.code == grpc.StatusCode.CANCELLED else "unavailable"
                                if exc.code == grpc.StatusCode.UNAVAILABLE else "internal")
            await context.abort(exc.code, str(exc))
        finally:
            await events.aclose()
            self.requests.remove(owner, request_id)
            admission.release(client)

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext  # noqa: N802
                    ) -> common_pb2.AbortResponse:
        """Aborts the caller's own requests of that id (label); another caller's are not found."""
        ids = self.requests.of((caller(context), request.request_id))
        found = [self.frontend.orchestrator.abort(internal_id) for internal_id in ids]
        return common_pb2.AbortResponse(found=any(found))

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


async def start_router_server(frontend: Frontend, host: str = "127.0.0.1", port: int = 0,
                              api_key: str | None = None) -> tuple[grpc.aio.Server, str]:
    """Start the gRPC front door, a grpc.aio server on the running loop (the orchestrator's), with reflection
    (behind `api_key` when given); returns (server, "host:port")."""
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = grpc.aio.server(interceptors=interceptors, options=[OWN_PORT])
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(frontend), server)
    names = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = bind_port(server, host, port)
    await server.start()
    return server, f"{host}:{bound}"
