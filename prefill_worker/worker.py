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
from hybridserve.engine.request import Request
from hybridserve.models.fingerprint import model_fingerprint
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import start_server, worker_threads
from hybridserve.proto.convert import sampling_from_proto
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.transfer.early_state import EarlyState
from hybridserve.transfer.layer_staging import LayerStager
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.planes import GRPC, TransferConfig
from hybridserve.transfer.sender import PUSH_TIMEOUT_S, StagedState, StateSender
from hybridserve.transfer.state_layout import StateTensorSpec, split_kv_specs, state_views
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
        early: EarlyState | None = None
        pushed: Future | None = None
        # spec decoding's drafter KV and TP's gathered export are staged whole, at the end
        if self.engine.spec is None and self.engine.tp is None and self.sender.sends_early(request.decode_address, specs):
            early = EarlyState(self._early_specs(specs), digest_on_device=self.sender.device.type == "cuda")
            pushed = self.sender.push_early(request.decode_address, header, early)
        try:
            first, staged = self._prefill_and_stage(prompt, params, request_id, specs, early)
        except BaseException as exc:
            if early is not None:
                self._end_early(early, pushed, exc)
            # aborted (the router or its client gone) or failed: counted by its reason, never lost
            self.metrics.observe_finished(len(prompt), 0, "abort" if isinstance(exc, PrefillAborted) else "error")
            raise
        header = dataclasses.replace(header, first_token=first.token_ids[0], num_cached_tokens=first.num_cached_tokens)
        self.metrics.observe_finished(len(prompt), 1, first.finish_reason or "")
        start = time.perf_counter()  # early: what is left of the transfer once the first token is known
        logger.info("first token of %s at %.3f", request_id, time.time())
        try:
            if early is not None and pushed is not None and early.streaming:
                early.finish(header.first_token, header.num_cached_tokens)
                plane, num_bytes = GRPC, self._end_early(early, pushed, None)
            else:
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

    def _early_specs(self, specs: list[StateTensorSpec]) -> list[StateTensorSpec]:
        """The layout of an early-sent state: with the layer path, the KV rows one prefill chunk may hold go
        behind the Mamba states (`split_kv_specs`): the rows before them are final before the last chunk's forward
        (no chunk is longer), so its Mamba states follow them at once instead of waiting for the last attention
        layer. The usual send (declined early) keeps `specs`."""
        head = specs[0].shape[0] - self.engine.scheduler.prefill_chunk_size
        if not self.sender.config.grpc_layer_send or head <= 0 or all(s.name != "ssm" for s in specs):
            return specs
        return split_kv_specs(specs, head)

    def _end_early(self, early: EarlyState, pushed: Future | None, error: BaseException | None) -> int:
        """Wait for an early send to end (cancelled first if `error`: the prefill failed), free its block;
        the bytes sent."""
        if error is not None:
            early.fail(error)
        try:
            if pushed is None:
                return 0
            if error is not None:
                try:
                    pushed.result(timeout=PUSH_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - the prefill's own error is the one reported
                    logger.debug("early send of a failed prefill ended", exc_info=True)
                return 0
            sent = int(pushed.result())
            logger.info("early send of %.1f MiB: %.1f MiB handed to the streams before the last prefill step "
                        "staged the rest, %.1f MiB before the first token", early.total_bytes / 2**20,
                        (early.handed_before_last or 0) / 2**20, (early.handed_before_tail or 0) / 2**20)
            return sent
        finally:
            self.sender.release_block(early.block)

    def _prefill_and_stage(
        self, prompt: list[int], params: SamplingParams, request_id: str, specs: list[StateTensorSpec],
        early: EarlyState | None = None,
    ) -> tuple[RequestOutput, StagedState]:
        """Prefill, then stage the state. At the end of the step the prompt finishes in, the engine exports it
        into an arena block if one is free right then (pages and slot free in that step, no extra trip to the
        loop); otherwise the state stays held and is staged here, waiting for room as `TransferConfig` says.
        No block is taken before the prompt computed its first chunk: a queued request holding one could starve
        finished ones that hold the engine's slots while they wait for arena room. With `early`, the KV of each
        finished chunk is staged at the end of its step (into a block taken at the first chunk boundary, if one
        is free then), the last step's forward stages the rest of the KV and each Mamba layer's state as its
        layer finishes (`LayerStager`, with `grpc_layer_send`) and the step's end what is left."""
        exported: Future[StagedState | None] = Future()

        def progress_on_loop(request: Request) -> None:  # on the loop thread, after each unfinished chunk
            assert early is not None  # registered only with an early state
            if early.block is None:
                block = self.sender.reserve_block(early.specs, timeout=0.0)
                if block is None:
                    early.decline()  # no room now: sent the usual way once the prompt is done
                    return
                early.begin(block)
            done = min(request.num_computed_tokens, early.num_tokens)
            if done > early.staged_tokens:
                early.stage_kv(self.engine.cache, request.page_ids, done)
                early.advance(done, self.sender.mark_staged())

        def export_on_loop(rid: str) -> None:  # on the loop thread; never waits
            if early is not None and early.block is not None:
                try:
                    self.engine.export_state(rid, early.rest_views())
                    ready = self.sender.mark_staged()
                    early.staged(ready)
                    views = early.views
                    exported.set_result(StagedState(early.specs, [views[s.name] for s in early.specs], early.block,
                                                    ready))
                except BaseException as exc:
                    exported.set_exception(exc)
                return
            if early is not None:
                early.decline()  # the prompt finished in its first step
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
            on_progress = progress_on_loop if early is not None else None
            on_layer = (LayerStager(early, self.engine.cache, self.engine.model_config, self.sender.device)
                        if early is not None and self.sender.config.grpc_layer_send else None)
            for out in self.loop.generate(prompt, params, request_id, hold_state=True, on_held=export_on_loop,
                                          on_progress=on_progress, on_layer=on_layer):
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
                if done is not None and (early is None or done.block is not early.block):  # early's: freed by it
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
