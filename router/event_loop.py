"""The router's one event loop, on its own thread: the orchestrator, its grpc.aio channels to the workers, the
HTTP server (uvicorn) and the gRPC front door (grpc.aio server) all run on it, so a request never crosses
threads. Code on other threads (tests, tools, drain on SIGTERM) submits coroutines with `run()`.

uvloop is used when installed (it comes with uvicorn[standard]): it measured faster on the router's request
path (bench/serving/router_overhead.py, bench/results/cpu/router/).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """uvloop's loop when asked for and installed, asyncio's otherwise."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            logger.info("uvloop is not installed: the router runs on asyncio's own event loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def task_cancelling() -> bool:
    """Whether the current task is being cancelled (Python >= 3.11 tells; on 3.10 this says False, so a
    CancelledError there counts as the cancel of a call rather than of the task)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


class LoopThread:
    """An asyncio event loop running forever on a daemon thread until `stop()`."""

    def __init__(self, name: str = "router-loop", use_uvloop: bool = True) -> None:
        self.loop = new_event_loop(use_uvloop)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop from another thread and wait for its result (its exception is raised here)."""
        if self.on_loop():
            coro.close()
            raise RuntimeError("LoopThread.run() was called on the loop's own thread: await the coroutine instead")
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the router's event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Call `fn(*args)` on the loop: at once when already on it, else scheduled from this thread."""
        if self.on_loop():
            fn(*args)
        elif self.loop.is_running():
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive() and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.on_loop():
            self._thread.join(timeout=timeout_s)
