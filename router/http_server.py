"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn), plus health, readiness, metrics and the
Prometheus http_sd target list.

FastAPI gives request validation into OpenAI-style 400s with little code and async streaming (SSE) whose
task is cancelled when the client disconnects, which is how aborts reach the workers. Admission control
wraps every generation: 429 when the router queue is full, 503 when a request waited too long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.router.admission import Overloaded
from hybridserve.router.auth import ApiKeys, authorized, protected
from hybridserve.router.client_waits import ClientGone, unless_disconnected
from hybridserve.router.config import MAX_BODY_BYTES
from hybridserve.router.connection_guard import ConnectionLimits, guarded_protocol
from hybridserve.router.event_loop import LoopThread
from hybridserve.router.frontend import Frontend
from hybridserve.router.metrics import RouterMetrics
from hybridserve.router.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_message,
)
from hybridserve.router.openai_service import OpenAIService
from hybridserve.router.request_checks import check_request_id, parse_json_body

logger = logging.getLogger(__name__)

BIG_BODY_BYTES = 64 * 1024  # bodies above this are parsed and validated on a thread, off the router's loop
_STATUS_KIND = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                409: "conflict", 413: "too_large", 500: "internal",
                429: "overloaded", 499: "cancelled", 503: "unavailable", 504: "timeout"}


def _error(exc: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def create_app(frontend: Frontend, targets: Callable[[], list[dict]] | None = None,
               api_keys: ApiKeys | str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> GenerationFastPath:
    """The ASGI app (FastAPI behind the generation fast path); `targets` returns the http_sd target groups of
    every component; with `api_keys` the /v1 routes need `Authorization: Bearer <one of them>` (401 otherwise);
    bodies over `max_body_bytes` get 413. Every error, 404 / 405 / 500 included, has the OpenAI error body."""
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys.load(api_keys)
    app = FastAPI(title="hybridserve", docs_url=None, redoc_url=None)
    service = OpenAIService(frontend)
    metrics = frontend.metrics

    def count(endpoint: str, status: int) -> None:
        metrics.count_request(endpoint, str(status))
        if status >= 400:
            metrics.count_error(_STATUS_KIND.get(status, "internal"))

    def internal_error(endpoint: str, exc: BaseException, request_id: str | None = None) -> JSONResponse:
        """A 500 whose body names no internals (addresses, library paths): they go to the log with the id."""
        request_id = request_id or uuid.uuid4().hex
        logger.error("request %s to %s failed", request_id, endpoint, exc_info=exc)
        count(endpoint, 500)
        return _error(ApiError(500, f"internal error (request id {request_id}); the server log has the details",
                               "server_error", code="internal"))

    def refused(request: Request) -> Response | None:
        """The 401 of a request to a protected path without the API key (None: let it through)."""
        if keys and protected(request.url.path) and not authorized(request.headers.get("authorization"), keys):
            count(request.url.path, 401)
            return _error(ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key"))
        return None

    if keys:
        @app.middleware("http")
        async def _require_key(request: Request, call_next):  # noqa: ANN202 - Starlette's middleware signature
            return refused(request) or await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        count(request.url.path, 400)
        return _error(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths (404), wrong methods (405) and the like, in the OpenAI error shape."""
        count("other", exc.status_code)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; this server serves /v1/completions, /v1/chat/completions, /v1/models"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(ApiError(exc.status_code, message, code=_STATUS_KIND.get(exc.status_code)),
                      dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request.url.path, exc)

    def validate(raw: bytearray, model):  # noqa: ANN202 - the pydantic model given
        data = parse_json_body(raw)  # bounded nesting, no NaN, valid Unicode: 400 otherwise
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise ApiError(400, message, param=param) from exc
        if len(raw) > BIG_BODY_BYTES and hasattr(req, "grammar"):
            req.grammar()  # a large schema's serialization: here, on the thread, not on the loop
        return req

    async def parse(request: Request, model):
        """The body as `model`, or ApiError 400 (malformed JSON, wrong types, unsupported values)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"the request body has {declared} bytes; this server takes at most {max_body_bytes}")
        raw = bytearray()
        async for piece in request.stream():  # read at most the limit, whatever the headers said
            raw += piece
            if len(raw) > max_body_bytes:
                raise ApiError(413, f"the request body is over {max_body_bytes} bytes, this server's limit")
        # a big body (a large schema) is parsed on a thread: on this loop it would hold up every stream it relays
        req = validate(raw, model) if len(raw) <= BIG_BODY_BYTES else await asyncio.to_thread(validate, raw, model)
        if req.model != frontend.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {frontend.model_name!r}",
                           param="model", code="model_not_found")
        return req

    async def generate(request: Request, model, handler, endpoint: str) -> Response:
        # the internal id is always ours and unguessable: two clients sending one x-request-id must not share
        # (or abort) each other's work; the client's id is a label for logs, echoed back in the response header
        request_id = uuid.uuid4().hex
        label = request.headers.get("x-request-id") or request_id
        if label != request_id:
            logger.debug("request %s is %s", label, request_id)
        client = keys.identity(request.headers.get("authorization"), request.client.host if request.client else "")
        try:
            check_request_id(label, "x-request-id")
            req = await parse(request, model)
            if not frontend.admission.try_acquire(client):  # wait in line, on the loop; a client that leaves, leaves it
                await unless_disconnected(request, frontend.admission.acquire_async(client))
        except ClientGone:
            count(endpoint, 499)
            return Response(status_code=499)
        except ApiError as exc:
            count(endpoint, exc.status)
            return _error(exc)
        except Overloaded as exc:
            status = 429 if exc.queue_full else 503
            count(endpoint, status)
            return _error(ApiError(status, str(exc), "server_error", code="overloaded"),
                          {"Retry-After": str(exc.retryable_after_s)})
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                frontend.admission.release(client)

        try:
            result = await unless_disconnected(request, handler(req, request_id))
        except ClientGone:  # a client that leaves before the answer aborts the work
            count(endpoint, 499)
            release()
            return Response(status_code=499)
        except ApiError as exc:
            release()
            count(endpoint, exc.status)
            return _error(exc)
        except Exception as exc:  # a bug: logged with the request id, answered in the OpenAI shape
            release()
            return internal_error(endpoint, exc, request_id)
        except BaseException:
            release()
            raise
        if isinstance(result, dict):
            release()
            count(endpoint, 200)
            return JSONResponse(result, headers={"x-request-id": label})

        async def body() -> AsyncIterator[str]:
            status = 499  # unless the stream ends: the client closed the connection (nginx's status for it)
            try:
                async for piece in result:
                    yield piece
                status = 200
            except Exception:  # the status line went out already: the stream just ends, the log has why
                status = 500
                logger.exception("stream of request %s (%s) failed", label, request_id)
            finally:  # also on disconnect: Starlette cancels this generator, closing `result` aborts the work
                count(endpoint, status)
                await result.aclose()
                release()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"x-request-id": label, "cache-control": "no-cache"})

    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, service.completions, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, service.chat, "/v1/chat/completions")

    # plain Starlette routes: the endpoints take the raw request and parse it themselves, so FastAPI's
    # per-request dependency solving and endpoint wrapping would be pure overhead (the fast path below serves
    # them; the routes keep routing, trailing-slash redirects and 405s as they were)
    generation: dict[str, Callable[[Request], Awaitable[Response]]] = {
        "/v1/completions": completions, "/v1/chat/completions": chat_completions}
    for path, endpoint in generation.items():
        app.add_route(path, endpoint, methods=["POST"])

    async def simple(request: Request, model, answer: Callable[[Any], dict], endpoint: str) -> JSONResponse:
        """A request answered at once from the router (no worker): parse, answer, count."""
        try:
            result = answer(await parse(request, model))
        except ApiError as exc:
            count(endpoint, exc.status)
            return _error(exc)
        count(endpoint, 200)
        return JSONResponse(result)

    # vLLM serves these without the /v1 prefix; both spellings answer (and need the API key when one is set)
    def route(path: str, model, answer: Callable[[Any], dict]) -> None:
        async def endpoint(request: Request) -> JSONResponse:
            return await simple(request, model, answer, path)

        app.post(path)(endpoint)

    for prefix in ("", "/v1"):
        route(f"{prefix}/tokenize", TokenizeRequest, service.tokenize)
        route(f"{prefix}/detokenize", DetokenizeRequest, service.detokenize)

    created = int(time.time())  # when this server started serving the model (the OpenAI field is a Unix time)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": created,
                                            "owned_by": "hybridserve", "max_model_len": frontend.max_model_len}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        prefill, decode = frontend.orchestrator.workers.snapshot()
        healthy = {role: sum(1 for h in handles if h.serving) for role, handles in (("prefill", prefill), ("decode", decode))}
        unhealthy = {f"{h.role} {h.address}": why for h in prefill + decode if (why := h.problem()) is not None}
        ok = healthy["decode"] > 0 and not frontend.admission.draining  # draining: SIGTERM, shutting down
        status = "ready" if ok and frontend.path_warm else "warming_up" if ok else "not_ready"
        body: dict = {"status": status, "healthy_workers": healthy}
        if unhealthy:
            body["unhealthy_workers"] = unhealthy
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        refresh_gauges(frontend)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/targets")
    async def http_sd() -> JSONResponse:
        return JSONResponse(targets() if targets is not None else [])

    return GenerationFastPath(app, generation, refused, metrics)


class GenerationFastPath:
    """The ASGI app in front of FastAPI: a POST to a generation route goes straight to its endpoint, anything
    else through FastAPI. FastAPI's middleware stack (error, telemetry, body-limit, exception and exit-stack
    layers, ~10 frames) is resumed at every await of a request; the generation endpoints need none of it: they
    parse the body and answer their errors themselves, the API key is checked here as the middleware does, and
    an exception escaping them still reaches uvicorn, which answers 500 and logs it."""

    def __init__(self, app: FastAPI, endpoints: dict[str, Callable[[Request], Awaitable[Response]]],
                 refused: Callable[[Request], Response | None], metrics: RouterMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self._endpoints = endpoints
        self._refused = refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = self._refused(request) or await endpoint(request)
        except Exception:  # the endpoints answer their errors; anything else is a bug, logged, answered as JSON
            logger.exception("%s failed", scope["path"])
            response = _error(ApiError(500, "internal error; the server log has the details", "server_error",
                                       code="internal"))
        await response(scope, receive, send)


def refresh_gauges(frontend: Frontend) -> None:
    """Gauges computed at scrape time: index size and breaker states."""
    from hybridserve.router.circuit_breaker import STATE_VALUES

    metrics = frontend.metrics
    metrics.index_nodes.set(frontend.orchestrator.index.num_nodes())
    for handle in frontend.orchestrator.workers.all():
        metrics.breaker.labels(handle.role, handle.address).set(STATE_VALUES[handle.breaker.state])


class HttpServer:
    """uvicorn on the router's event loop (the orchestrator's: a request never crosses threads), with a bound
    port to report (port 0 picks a free one)."""

    def __init__(self, app: GenerationFastPath, host: str, port: int, loop: LoopThread,
                 limits: ConnectionLimits | None = None) -> None:
        protocol = guarded_protocol(limits or ConnectionLimits(), app.metrics)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
                                http=protocol)
        self._server = uvicorn.Server(config)
        self._loop = loop
        self._serving: concurrent.futures.Future | None = None
        self.host = host
        self.port = port

    async def _serve(self) -> None:
        """uvicorn's serve(), its start-up failure (sys.exit on a port in use) as an OSError: a SystemExit would
        end the router's whole event loop thread."""
        try:
            await self._server.serve()
        except SystemExit:
            raise OSError(f"the HTTP server could not bind {self.host}:{self.port}") from None

    def start(self, timeout_s: float = 30.0) -> str:
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop.loop)
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._serving.done() or time.monotonic() > deadline:
                failure = self._serving.exception() if self._serving.done() else None
                self._serving = None
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}"
                                   f"{f': {failure}' if failure else ''}")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        if self._serving is not None:
            try:
                self._serving.result(timeout=10)
            except Exception:  # stopping anyway
                logger.exception("the HTTP server did not stop cleanly")
