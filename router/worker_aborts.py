"""Aborting a request on the workers that hold it (decode, prefill, and the router's session with the decode
worker), in tasks of their own: an abort runs to its end even when the request's own task is being cancelled,
and the caller's error goes out without waiting for it; closing the router waits for the ones still running."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import grpc

from hybridserve.proto import common_pb2
from hybridserve.router.policy import Decision
from hybridserve.router.worker_session import WorkerSession

logger = logging.getLogger(__name__)


class WorkerAborts:
    """The abort tasks still running; each frees the request's decode seat once it is through."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # each Abort call's deadline
        self._tasks: set[asyncio.Task] = set()

    def start(self, d: Decision, request_id: str, session: WorkerSession | None) -> asyncio.Task:
        """Abort `request_id` on the workers of decision `d`, in a task on the running loop."""
        task = asyncio.get_running_loop().create_task(self._abort_all(d, request_id, session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Until the aborts still running are done (at most `timeout_s`)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def _abort_all(self, d: Decision, request_id: str, session: WorkerSession | None) -> None:
        # a local request on the session is aborted there, behind its generate (a call could overtake it); one
        # prefilled elsewhere by the Abort call (its reservation is the anchor, in either order; the call's answer
        # means it is done, before a retry may reserve the same id again), and on the session too, which only
        # stops its token stream there
        calls: list[Awaitable[Any]] = [
            worker.aio_stub().Abort(common_pb2.AbortRequest(request_id=request_id), timeout=self.timeout_s,
                                    metadata=worker.metadata)
            for worker in (d.decode, d.prefill)
            if worker is not None and not (worker is d.decode and session is not None and d.local)]
        if session is not None:
            calls.append(session.abort(request_id))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, grpc.RpcError):
                logger.warning("aborting request %s on its workers failed: %r", request_id, result)
            # an RpcError: the worker is gone; its reservation expires on its own
        d.decode.seats.seat_freed()
