"""How a request fails on its workers, as the orchestrator tells it apart: an error to report, a retryable
failure before the first token, or a decode worker that is full for now."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from hybridserve.router.workers import WorkerHandle


class WorkerError(RuntimeError):
    """A request failed on the workers; `code` is the gRPC status to report. `public`: the message for the
    client, without internal addresses (the full message goes to the router's log)."""

    def __init__(self, code: grpc.StatusCode, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.public = public if public is not None else message


class RetryElsewhere(Exception):
    """A worker failed retryably before the first token: exclude it and try again."""

    def __init__(self, worker: WorkerHandle, stage: str, error: grpc.RpcError) -> None:
        super().__init__(f"{stage} on {worker.address}: {error.code()} {error.details()}")
        self.worker, self.stage, self.error = worker, stage, error


class WorkerBusy(RetryElsewhere):
    """The decode worker has no free state slot or KV pages for the request now: wait, then ask again."""
