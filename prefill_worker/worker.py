"""The prefill worker: chunked prefill with its own prefix cache, then the state streamed to a decode worker.

A plain class with a gRPC server; Ray actors and the process launcher wrap it. For each Prefill call the
engine computes the prompt (reusing cached aligned checkpoints), samples the first token, and holds the
request's pages and slot until the state is gathered; then PushState streams it to the decode worker that
holds the reservation, over the data plane both workers share (`hybridserve.transfer`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import grpc

from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.handoff import CapacityError
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.models.fingerprint import model_fingerprint
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import start_server, worker_threads
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.planes import TransferConfig
from hybridserve.transfer.sender import StagedState, StateSender
from hybridserve.transfer.state_layout import StateTensorSpec, state_views
from hybridserve.worker_runtime.cache_event_feed import CacheEventFeed
from hybridserve.worker_runtime.drain import DRAINING_STATUS, Drain
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.health import HealthAnswer, health_response
from hybridserve.worker_runtime.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)



class PrefillAborted(RuntimeError):
    """The prefill's request was aborted (the router, or its client, went away) before its first token."""


class PrefillWorker:
    """Engine loop + gRPC server for the prefill role."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, host: str = "127.0.0.1", port: int = 0,
                 worker_id: str | None = None, metrics_port: int | None = 0,
                 transfer: TransferConfig | None = None, internal_token: str | None = None,
                 internal_tls: InternalTlsConfig | None = None) -> None:
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.engine = LLMEngine(model_dir, config)
        self.fingerprint = model_fingerprint(
            model_dir, config.dtype, self.engine.model_config.ssm_state_dtype, config.load_format, config.seed
        )
        self.transfer = transfer or TransferConfig()
        self._internal_token = internal_token  # required on every call to this worker, sent on calls to decode workers
        self._internal_tls = internal_tls  # mutual TLS on its port and on its channels to decode workers
        self.sender = StateSender(self.transfer, self.engine.config.torch_device, internal_token, host, internal_tls)
        # outputs at once, not late: a prefill's one output releases its state push, which must not wait for the next
        # (often long, eagerly launched) chunk's launch; there are no per-token streams here to keep off the GIL
        self.loop = EngineLoop(self.engine, name=f"{self.worker_id}-loop", late_handoff=False)
        self.events = CacheEventFeed(self.worker_id, self.loop)
        self.metrics = WorkerMetrics(self.loop, "prefill")
        self._health_answer = HealthAnswer(self.loop, lambda: health_response(
            "prefill", self.worker_id, self.fingerprint, self.engine, self.metrics.port, self.transfer))
        self._metrics_port = metrics_port  # None: no /metrics server
        self._host, self._port = host, port
        self._server: grpc.Server | None = None
        self.drain_state = Drain()  # in flight: Prefill calls

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def start(self) -> str:
        self._server, self._port = start_server(
            self._host, self._port,
            lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), server),
            max_workers=worker_threads(self.engine.config.max_num_seqs), token=self._internal_token,
            tls=self._internal_tls,
        )
        if self._metrics_port is not None:
            self.metrics.start(self._host, self._metrics_port)
        logger.info("prefill worker %s serving on %s (transfer planes %s)", self.worker_id, self.address,
                    self.sender.planes)
        return self.address

    def drain(self, timeout_s: float) -> list[str]:
        """SIGTERM: refuse new prefills, let in-flight ones finish up to `timeout_s`, abort the rest; returns
        the aborted ids. Call stop() after."""
        error = RuntimeError("the prefill worker shut down before the prefill finished (drain timeout)")
        return self.drain_state.drain(timeout_s, lambda rid: self.loop.fail(rid, error))

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
        self.metrics.stop()
        self.loop.stop()
        self.sender.close()

    def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        """Compute the prompt, sample the first token, stage the state and move it; raises on any failure."""
        params = sampling_from_proto(request.sampling)
        # one token here; min_tokens still keeps EOS from being that token; the decode worker matches stop
        # strings, the first token's included (it commits the first token through the same stop rules)
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        prompt = list(request.prompt_token_ids)
        request_id = request.request_id
        specs = self.engine.state_specs(len(prompt))  # cache geometry only: safe off the loop thread
        header = StateHeader(ticket=request.ticket, request_id=request_id, model_fingerprint=self.fingerprint,
                             num_tokens=len(prompt), first_token=0, num_cached_tokens=0)
        try:
            first, staged = self._prefill_and_stage(prompt, params, request_id, specs)
        except BaseException as exc:
            # aborted (the router or its client gone) or failed: counted by its reason, never lost
            self.metrics.observe_finished(len(prompt), 0, "abort" if isinstance(exc, PrefillAborted) else "error")
            raise
        header = dataclasses.replace(header, first_token=first.token_ids[0], num_cached_tokens=first.num_cached_tokens)
        self.metrics.observe_finished(len(prompt), 1, first.finish_reason or "")
        start = time.perf_counter()
        logger.info("first token of %s at %.3f", request_id, time.time())
        try:
            plane, num_bytes = self.sender.send(request.decode_address, header, staged)
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
            plane=plane,
        )

    def _prefill_and_stage(
        self, prompt: list[int], params: SamplingParams, request_id: str, specs: list[StateTensorSpec],
    ) -> tuple[RequestOutput, StagedState]:
        """Prefill, then stage the state. At the end of the step the prompt finishes in, the engine exports it
        into an arena block if one is free right then (pages and slot free in that step, no extra trip to the
        loop); otherwise the state stays held and is staged here, waiting for room as `TransferConfig` says.
        No block is taken before the prompt computed its first chunk: a queued request holding one could starve
        finished ones that hold the engine's slots while they wait for arena room."""
        exported: Future[StagedState | None] = Future()

        def export_on_loop(rid: str) -> None:  # on the loop thread; never waits
            block = None
            try:
                block = self.sender.reserve_block(specs, timeout=0.0)
                if block is None:
                    exported.set_result(None)  # no room now: staged after, by the handler
                    return
                parts = self.engine.export_state(rid, state_views(block.data, specs)).parts
                exported.set_result(StagedState(specs, parts, block, self.sender.mark_staged()))
            except BaseException as exc:
                self.sender.release_block(block)
                exported.set_exception(exc)

        first = None
        staged: StagedState | None = None
        try:
            for out in self.loop.generate(prompt, params, request_id, hold_state=True, on_held=export_on_loop):
                first = out
            if first is None or first.finish_reason == "abort":
                raise PrefillAborted(f"prefill of {request_id} was aborted")
            if not exported.done():  # held without the end-of-step hook having run: run it now
                self.loop.call(lambda: export_on_loop(request_id))
            staged = exported.result()
            if staged is None:
                staged = self.sender.stage(
                    specs, self.loop.call, lambda views: self.engine.export_state(request_id, views).parts)
            return first, staged
        except BaseException:
            self.loop.call(lambda: self.engine.abort(request_id))  # never leave a held state behind
            if staged is None and exported.done() and exported.exception() is None:
                done = exported.result()
                if done is not None:
                    self.sender.release_block(done.block)  # staged, but nobody will send it
            raise

    def health(self) -> common_pb2.HealthResponse:
        health = self._health_answer()
        if self.drain_state.draining:
            health.status = DRAINING_STATUS
        return health


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request, context):  # noqa: N802 - gRPC method names
        self.worker.drain_state.refuse_new(context)
        try:
            with self.worker.drain_state.track(request.request_id):
                return self.worker.prefill(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:  # the waiting queue is full: the router answers 429
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except grpc.RpcError as exc:  # the decode side refused or went away
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNAVAILABLE
            details = exc.details() if hasattr(exc, "details") else exc
            context.abort(code, f"state transfer to {request.decode_address} failed: {details}")
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))

    def Abort(self, request, context):  # noqa: N802
        found = self.worker.loop.call(lambda: self.worker.engine.abort(request.request_id))
        return common_pb2.AbortResponse(found=bool(found))

    def Health(self, request, context):  # noqa: N802
        return self.worker.health()

    def CacheEvents(self, request, context):  # noqa: N802
        yield from self.worker.events.stream(request.since_sequence, context, request.snapshot)
