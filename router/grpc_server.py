"""The gRPC front door: `hybridserve.v1.Router/Generate` over the orchestrator (text or token-id prompts)."""

from __future__ import annotations

import logging
import uuid
from concurrent import futures
from pathlib import Path

import grpc

from hybridserve.models.tokenizer import Tokenizer, load_tokenizer
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.router.orchestrator import Orchestrator, WorkerError

logger = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def _prompt(self, request, context) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if self.tokenizer is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this model has no tokenizer: send token_ids")
            return self.tokenizer.encode(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a request needs a prompt: text or token_ids")

    def Generate(self, request, context):  # noqa: N802 - gRPC method names
        prompt = self._prompt(request, context)
        if not prompt:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be < {self.vocab_size}; got {bad[:5]}")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        tokens: list[int] = []
        text = ""
        try:
            for event in self.orchestrator.generate(prompt, params, request_id):
                tokens.extend(event.token_ids)
                delta = ""
                if self.tokenizer is not None:
                    full = self.tokenizer.decode(tokens)
                    delta, text = full[len(text) :], full
                yield router_pb2.GenerateResponse(event=event, text_delta=delta)
        except WorkerError as exc:
            context.abort(exc.code, str(exc))

    def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(found=False)

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="router")


def start_router_server(
    orchestrator: Orchestrator, model_dir: str | Path, vocab_size: int, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.Server, str]:
    """Start the front door; returns (server, "host:port")."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(orchestrator, load_tokenizer(model_dir), vocab_size), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, f"{host}:{bound}"
