"""The floor under the router's overhead: a bare proxy with the router's transport stack and none of its logic.

One process, one uvloop event loop (as the router), serving
- gRPC: `hybridserve.v1.Router/Generate` on grpc.aio, forwarding to the stub worker's GenerateLocal over a
  grpc.aio channel and relaying each event (no admission, routing, metrics, text, read-ahead buffer);
- HTTP: POST /v1/completions as a raw ASGI app on uvicorn (no FastAPI, no validation), the same forward,
  answering one small JSON body.

`bench/serving/router_overhead.py` measures it beside the router ("floor_grpc", "floor_http"): the router's added
latency and CPU minus the floor's is what its own Python costs; the floor is what grpc.aio, uvicorn and the
extra hop cost, which no router code change removes.

`serve_direct_http` is the HTTP client's direct baseline: the same uvicorn + raw ASGI stack answering
/v1/completions itself with the stub worker's tokens (an engine's own HTTP server over a free engine), so the
HTTP door's added latency is measured HTTP to HTTP, as the gRPC door's is gRPC to gRPC: the client's own protocol
cost (httpx is slower per request than a gRPC stub) is not the router's.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any


async def _json_body(receive: Any) -> dict:
    """An ASGI request's whole body, parsed as JSON."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return json.loads(body)


def serve_floor(stub_address: str, queue: Any) -> None:
    """Child process: the bare proxy over the stub worker, until killed; puts (grpc address, http address)."""
    import grpc
    import uvicorn

    from hybridserve.proto import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
    from hybridserve.proto.channels import message_options
    from hybridserve.router.event_loop import new_event_loop

    class Proxy(router_pb2_grpc.RouterServicer):
        def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub) -> None:
            self.stub = stub

        async def Generate(self, request, context):  # noqa: N802
            call = self.stub.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=request.token_ids.ids, sampling=request.sampling),
                timeout=3600)
            async for event in call:
                yield router_pb2.GenerateResponse(event=event)

    async def main() -> None:
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.aio.insecure_channel(stub_address, options=message_options()))
        server = grpc.aio.server(options=message_options())
        router_pb2_grpc.add_RouterServicer_to_server(Proxy(stub), server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

        async def app(scope, receive, send) -> None:  # POST /v1/completions, token-id prompts only
            if scope["type"] != "http":
                return
            req = await _json_body(receive)
            call = stub.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=req["prompt"],
                sampling={"max_tokens": req["max_tokens"]}), timeout=3600)
            ids = [t async for event in call for t in event.token_ids]
            answer = json.dumps({"object": "text_completion", "choices": [
                {"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}]}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": answer})

        http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                             access_log=False))
        serving = asyncio.ensure_future(http.serve())
        while not http.started:
            await asyncio.sleep(0.02)
        http_port = http.servers[0].sockets[0].getsockname()[1]
        queue.put((f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"))
        await serving

    loop = new_event_loop()
    loop.run_until_complete(main())


def serve_direct_http(queue: Any) -> None:
    """Child process: POST /v1/completions answered in place with the stub worker's tokens (65 + i % 26, as
    bench/serving/router_overhead.py's stub), until killed; puts the HTTP address."""
    import uvicorn

    from hybridserve.router.event_loop import new_event_loop

    async def app(scope, receive, send) -> None:  # POST /v1/completions, token-id prompts only
        if scope["type"] != "http":
            return
        req = await _json_body(receive)
        ids = [65 + i % 26 for i in range(req["max_tokens"])]
        answer = json.dumps({"id": uuid.uuid4().hex, "object": "text_completion", "choices": [
            {"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    async def main() -> None:
        http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                             access_log=False))
        serving = asyncio.ensure_future(http.serve())
        while not http.started:
            await asyncio.sleep(0.02)
        queue.put(f"127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}")
        await serving

    new_event_loop().run_until_complete(main())
