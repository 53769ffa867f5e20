"""The prefill worker: chunked prefill with its own prefix cache, then the state streamed to a decode worker.

A plain class with a gRPC server; Ray actors and the process launcher wrap it. For each Prefill call the
engine computes the prompt (reusing cached aligned checkpoints), samples the first token, and holds the
request's pages and slot until the state is gathered; then PushState streams it to the decode worker that
holds the reservation.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from pathlib import Path

import grpc

from hybridserve.worker_runtime.cache_event_feed import CacheEventFeed
from hybridserve.engine.config import EngineConfig
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.worker_metrics import WorkerMetrics
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.worker_runtime.health import health_fields
from hybridserve.models.fingerprint import model_fingerprint
from hybridserve.transfer.grpc_sender import DEFAULT_CHUNK_BYTES, StateHeader, encode_state_streams
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import insecure_channel, start_server, worker_threads
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.transfer.grpc_wire import push_state_stub

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 120.0
DEFAULT_TRANSFER_STREAMS = 2  # parallel PushState streams: one Python gRPC stream saturates near 0.7 GB/s


class PrefillWorker:
    """Engine loop + gRPC server for the prefill role."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, host: str = "127.0.0.1", port: int = 0,
                 worker_id: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 metrics_port: int | None = 0, transfer_streams: int = DEFAULT_TRANSFER_STREAMS) -> None:
        if transfer_streams <= 0:
            raise ValueError(f"transfer_streams must be positive, got {transfer_streams}")
        self.transfer_streams = transfer_streams
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.engine = LLMEngine(model_dir, config)
        self.fingerprint = model_fingerprint(
            model_dir, config.dtype, self.engine.model_config.ssm_state_dtype, config.load_format, config.seed
        )
        self.loop = EngineLoop(self.engine, name=f"{self.worker_id}-loop")
        self.events = CacheEventFeed(self.worker_id, self.loop)
        self.metrics = WorkerMetrics(self.loop, "prefill")
        self._metrics_port = metrics_port  # None: no /metrics server
        self.chunk_bytes = chunk_bytes
        self._push_calls: dict[str, object] = {}
        self._lock = threading.Lock()
        self._host, self._port = host, port
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def start(self) -> str:
        self._server, self._port = start_server(
            self._host, self._port,
            lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), server),
            max_workers=worker_threads(self.engine.config.max_num_seqs),
        )
        if self._metrics_port is not None:
            self.metrics.start(self._host, self._metrics_port)
        logger.info("prefill worker %s serving on %s", self.worker_id, self.address)
        return self.address

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
        self.metrics.stop()
        self.loop.stop()

    def push_state_calls(self, address: str) -> list:
        """One PushState callable per parallel stream to a decode worker, each on its own connection."""
        with self._lock:
            if address not in self._push_calls:
                calls = []
                for i in range(self.transfer_streams):
                    # distinct channel args: a connection of its own
                    calls.append(push_state_stub(insecure_channel(address, ("grpc.channel_id", i))))
                self._push_calls[address] = calls
            return self._push_calls[address]

    def push_state(self, address: str, header: StateHeader, exported) -> int:
        """Stream the state over `transfer_streams` parallel calls; returns the bytes the decode side took."""
        calls = self.push_state_calls(address)
        streams = encode_state_streams(
            header, exported.specs, exported.parts, self.chunk_bytes, pre_encoded=True, num_streams=len(calls)
        )
        if len(calls) == 1:
            replies = [calls[0](streams[0], timeout=PUSH_TIMEOUT_S)]
        else:
            pending = [call.future(stream, timeout=PUSH_TIMEOUT_S) for call, stream in zip(calls, streams)]
            replies = []
            try:
                replies = [f.result() for f in pending]
            finally:
                if len(replies) < len(pending):  # one failed: stop the others
                    for f in pending:
                        f.cancel()
        if sum(r.committed for r in replies) != 1:
            raise RuntimeError("the decode worker did not commit the state")
        return sum(r.bytes_received for r in replies)

    def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        """Compute the prompt, sample the first token, stream the state; raises on any failure."""
        params = dataclasses.replace(sampling_from_proto(request.sampling), max_tokens=1)
        prompt = list(request.prompt_token_ids)
        request_id = request.request_id
        first = None
        for out in self.loop.generate(prompt, params, request_id, hold_state=True):
            first = out
        if first is None or first.finish_reason == "abort":
            raise RuntimeError(f"prefill of {request_id} was aborted")
        exported = self.loop.call(lambda: self.engine.export_state(request_id))
        header = StateHeader(
            ticket=request.ticket,
            request_id=request_id,
            model_fingerprint=self.fingerprint,
            num_tokens=len(prompt),
            first_token=first.token_ids[0],
            num_cached_tokens=first.num_cached_tokens,
        )
        self.metrics.observe_finished(len(prompt), 1, first.finish_reason or "")
        start = time.perf_counter()
        try:
            num_bytes = self.push_state(request.decode_address, header, exported)
        except BaseException:
            self.metrics.observe_transfer(0, 0.0, ok=False)
            raise
        elapsed = time.perf_counter() - start
        self.metrics.observe_transfer(num_bytes, elapsed, ok=True)
        return worker_pb2.PrefillResponse(
            first_token=header.first_token,
            num_cached_tokens=header.num_cached_tokens,
            bytes_sent=num_bytes,
            transfer_seconds=elapsed,
        )

    def health(self) -> common_pb2.HealthResponse:
        def snapshot() -> common_pb2.HealthResponse:
            return common_pb2.HealthResponse(
                status="ok", role="prefill", model_fingerprint=self.fingerprint, **self.engine.stats(),
                **health_fields(self.worker_id, self.engine, self.metrics.port),
            )

        return self.loop.call(snapshot, timeout=10)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request, context):  # noqa: N802 - gRPC method names
        try:
            return self.worker.prefill(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except grpc.RpcError as exc:  # the decode side refused or went away
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"state push to {request.decode_address} failed: {exc.details() if hasattr(exc, 'details') else exc}")
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))

    def Abort(self, request, context):  # noqa: N802
        found = self.worker.loop.call(lambda: self.worker.engine.abort(request.request_id))
        return common_pb2.AbortResponse(found=bool(found))

    def Health(self, request, context):  # noqa: N802
        return self.worker.health()

    def CacheEvents(self, request, context):  # noqa: N802
        yield from self.worker.events.stream(request.since_sequence, context, request.snapshot)
