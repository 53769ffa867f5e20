"""Client-side orchestration of one disaggregated request: reserve on a decode worker, have a prefill
worker prefill into that reservation, stream the tokens back.

Short prompts skip the prefill worker (the decode worker prefills locally). A prefill worker that is
unavailable before the first token is retried on another one with a fresh reservation; every other failure
aborts the request on both workers and surfaces as an error event, never as a hang.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from hybridserve.engine.sampling_params import SamplingParams
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True)
class OrchestratorConfig:
    local_prefill_max_tokens: int = 0  # prompts at most this long are prefilled by the decode worker
    reserve_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    reservation_ttl_s: float = 120.0
    prefill_attempts: int = 2

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0 or self.prefill_attempts < 1:
            raise ValueError("local_prefill_max_tokens must be >= 0 and prefill_attempts >= 1")


class WorkerError(RuntimeError):
    """A request failed on the workers; `code` is the gRPC status to report."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _channel(address: str) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    return grpc.insecure_channel(address, options=options)


class Orchestrator:
    """Routes each request to one decode and (unless local) one prefill worker, round robin."""

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str],
                 config: OrchestratorConfig = OrchestratorConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._prefill_addresses: list[str] = []
        self._decode_addresses: list[str] = []
        self._prefill: list[worker_pb2_grpc.PrefillWorkerStub] = []
        self._decode: list[worker_pb2_grpc.DecodeWorkerStub] = []
        self.update_workers(prefill_addresses, decode_addresses)
        self._next_prefill = itertools.count()
        self._next_decode = itertools.count()
        self._pool = futures.ThreadPoolExecutor(max_workers=64)

    def update_workers(self, prefill_addresses: list[str], decode_addresses: list[str]) -> None:
        """Point at a new set of workers (after a restart moved one); in-flight requests keep their stubs."""
        if not decode_addresses:
            raise ValueError("at least one decode worker address is needed")
        with self._lock:
            if prefill_addresses != self._prefill_addresses:
                self._prefill = [worker_pb2_grpc.PrefillWorkerStub(_channel(a)) for a in prefill_addresses]
                self._prefill_addresses = list(prefill_addresses)
            if decode_addresses != self._decode_addresses:
                self._decode = [worker_pb2_grpc.DecodeWorkerStub(_channel(a)) for a in decode_addresses]
                self._decode_addresses = list(decode_addresses)

    def _pick(self, counter: itertools.count, n: int) -> int:
        return next(counter) % n  # itertools.count is atomic under the GIL

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Iterator[common_pb2.TokenEvent]:
        """TokenEvents of one request; raises WorkerError when it cannot be served."""
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            prefill_stubs, decode_stubs = self._prefill, self._decode
            decode_addresses = self._decode_addresses
        d = self._pick(self._next_decode, len(decode_stubs))
        decode = decode_stubs[d]
        sampling = sampling_to_proto(params)
        if not prefill_stubs or len(prompt_token_ids) <= self.config.local_prefill_max_tokens:
            local = worker_pb2.GenerateLocalRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling)
            yield from self._events(decode.GenerateLocal(local), request_id, decode, None)
            return
        last_error: grpc.RpcError | None = None
        for attempt in range(self.config.prefill_attempts):
            try:
                ticket = decode.Reserve(
                    worker_pb2.ReserveRequest(
                        request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
                        timeout_ms=int(self.config.reservation_ttl_s * 1000),
                    ),
                    timeout=self.config.reserve_timeout_s,
                ).ticket
            except grpc.RpcError as exc:
                raise WorkerError(exc.code(), f"decode worker refused the reservation: {exc.details()}") from exc
            tokens = decode.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket))
            p = self._pick(self._next_prefill, len(prefill_stubs))
            prefill_call = self._pool.submit(
                prefill_stubs[p].Prefill,
                worker_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
                    decode_address=decode_addresses[d], ticket=ticket,
                ),
                timeout=self.config.prefill_timeout_s,
            )
            try:
                prefill_call.result()
            except grpc.RpcError as exc:
                tokens.cancel()
                self._abort(decode, request_id)
                last_error = exc
                if exc.code() in _RETRYABLE and attempt + 1 < self.config.prefill_attempts:
                    logger.warning("prefill of %s failed (%s), retrying", request_id, exc.code())
                    continue
                raise WorkerError(exc.code(), f"prefill failed: {exc.details()}") from exc
            yield from self._events(tokens, request_id, decode, prefill_stubs[p])
            return
        raise WorkerError(last_error.code() if last_error else grpc.StatusCode.UNAVAILABLE, "prefill failed")

    def _events(self, call, request_id: str, decode, prefill) -> Iterator[common_pb2.TokenEvent]:
        finished = False
        try:
            for event in call:
                if event.finish_reason == "error":
                    raise WorkerError(grpc.StatusCode.INTERNAL, event.error or "decode failed")
                yield event
                if event.finish_reason:
                    finished = True
                    return
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, "the decode worker closed the stream early")
        except grpc.RpcError as exc:
            raise WorkerError(exc.code(), f"decode stream failed: {exc.details()}") from exc
        finally:
            if not finished:  # client went away or failure: free everything on both sides
                call.cancel()
                self._abort(decode, request_id)
                if prefill is not None:
                    self._abort(prefill, request_id)

    @staticmethod
    def _abort(stub, request_id: str) -> None:
        try:
            stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=5)
        except grpc.RpcError:
            pass  # the worker is gone; its reservation expires on its own
