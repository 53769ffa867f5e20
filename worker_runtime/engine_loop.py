"""Runs an `LLMEngine` on its own thread so that servers can talk to it from many threads.

The engine is single-threaded by design; every touch of it happens on the loop thread. Other threads
`call()` a function on the loop (run between two steps) and read each request's outputs from its own queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.tp_watch import RankError
from hybridserve.worker_runtime.loop_stats import LoopStats
from hybridserve.worker_runtime.step_profiler import StepProfileConfig, StepProfiler

logger = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.05


class OutputSink(Protocol):
    """Where the loop puts a request's outputs (and the error that ends it): a queue.Queue, or a session's
    tagged view of its shared queue."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


class RedirectableStream(queue.Queue):
    """A request's output queue that can be handed on to another sink once, keeping order: what was queued moves
    there first, and every later put goes there (a reserved request's outputs start before its reader is known:
    a token stream call reads the queue, a worker session redirects it into its shared queue)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._target: OutputSink | None = None

    def put(self, item: RequestOutput | BaseException, block: bool = True, timeout: float | None = None) -> None:
        with self._lock:
            if self._target is None:
                super().put(item, block, timeout)
                return
            target = self._target
        target.put(item)

    def redirect(self, sink: OutputSink) -> None:
        with self._lock:
            if self._target is not None:
                raise RuntimeError("the stream was redirected already")
            while True:
                try:
                    sink.put(self.get_nowait())
                except queue.Empty:
                    break
            self._target = sink


class EngineLoop:
    """`step()`s the engine while it has work; runs submitted calls between steps."""

    def __init__(self, engine: LLMEngine, name: str = "engine-loop", late_handoff: bool = True) -> None:
        self.engine = engine
        # late hand-off: a step's outputs reach their streams once the next step's forward is queued, so the threads
        # that send them run while the GPU computes instead of contending with the loop while it builds and
        # launches the step (each token then leaves one launch later). On by default: served TPOT -6 %, the decode
        # step's launch phase -36 % on the H200 (bench/results/h200/serving/). Off for a prefill worker, whose
        # one-token outputs start transfers that should not wait a step
        self.late_handoff = late_handoff
        self._pending: list[RequestOutput] = []  # outputs of the last step, not yet handed off (late hand-off)
        # host work that must not land on a step's launch: run on the loop thread once each forward is queued, while
        # the GPU computes (task(False)), and each time the loop finds itself idle (task(True)); owned by the loop.
        # Late hand-off is the first of them.
        self._overlap_tasks: list[Callable[[bool], None]] = [lambda idle: self._hand_off()] if self.late_handoff else []
        self._calls: queue.Queue[tuple[Callable[[], Any], Future | None]] = queue.Queue()  # None: posted
        self._streams: dict[str, OutputSink] = {}
        self._stop = threading.Event()
        self.fatal: BaseException | None = None  # what stopped the loop for good (a dead tensor-parallel rank)
        self.stats = LoopStats(name)
        profile = StepProfileConfig.from_engine(engine.config)  # profile_dir: a trace of a window of busy steps
        self.profiler = StepProfiler(profile, name) if profile is not None else None
        # monotonic start of the step running now (None between steps): how long the engine has made no progress
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def seconds_in_step(self) -> float:
        """How long the step running now has run (0 between steps): a worker whose engine holds requests and
        stays in one step this long makes no progress (health reports it)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    # ---- called from any thread ----------------------------------------------------------------
    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run fn on the loop thread between steps and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._stop.is_set():
            raise RuntimeError(f"the engine loop stopped{f': {self.fatal}' if self.fatal else ''}")
        future: Future = Future()
        self._calls.put((fn, future))
        if self._stop.is_set() and not self._thread.is_alive():  # stopped meanwhile: nobody will run it
            self._fail_calls()
        return future.result(timeout=timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the loop thread between steps without waiting for it (its exception is logged)."""
        if threading.current_thread() is self._thread:
            fn()
            return
        self._calls.put((fn, None))

    def add_overlap_task(self, task: Callable[[bool], None]) -> None:
        """Run `task(idle)` on the loop thread while every later forward computes (idle False) and whenever the loop
        idles (idle True): for Python work of other components (the cache event feed's protobufs) that would
        otherwise contend for the GIL with the loop while it builds and launches a step. A task's exception is
        logged; keep tasks short (they run before the step's tokens are waited for)."""
        self.post(lambda: self._overlap_tasks.append(task))

    def submit(self, request_id: str, add: Callable[[], Any]) -> RedirectableStream:
        """Open the request's output stream and run `add` (which puts the request into the engine) in ONE trip
        to the loop, so a new request waits for one step boundary, not two; a failing `add` closes the stream
        again and raises here."""
        stream = RedirectableStream()
        self.submit_to(request_id, add, stream)
        return stream

    def submit_to(self, request_id: str, add: Callable[[], Any], sink: OutputSink) -> None:
        """`submit` into a given sink (a worker session's tagged view of its shared queue: the loop hands every
        output straight to the one thread that sends them all)."""

        def open_and_add() -> None:
            self._streams[request_id] = sink
            try:
                add()
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        self.call(open_and_add)

    def submit_later(self, request_id: str, add: Callable[[], Any], sink: OutputSink,
                     refused: Callable[[BaseException], None]) -> None:
        """`submit_to` without waiting for the loop: the caller goes on at once (a session reader admitting
        many requests must not wait a step boundary for each); a failing `add` goes to `refused`, on the loop."""

        def open_and_add() -> None:
            self._streams[request_id] = sink
            try:
                add()
            except Exception as exc:
                self._streams.pop(request_id, None)
                refused(exc)

        self.post(open_and_add)

    def fail(self, request_id: str, error: BaseException) -> bool:
        """Abort a request and end its stream with `error` (its consumer raises it); False if unknown."""

        def run() -> bool:
            found = self.engine.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error)
            return bool(found) or stream is not None

        return bool(self.call(run))

    def close_stream(self, request_id: str, stream: OutputSink | None = None) -> None:
        """Forget the request's stream (no wait: nothing comes back); with `stream`, only if it is still that one
        (a new request of the same id may have opened its own meanwhile)."""

        def close() -> None:
            if stream is None or self._streams.get(request_id) is stream:
                self._streams.pop(request_id, None)

        self.post(close)

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, hold_state: bool = False,
        on_held: Callable[[str], None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes (`on_held`: see `LLMEngine.add_request`);
        CapacityError when the engine's waiting queue is full."""
        self.engine.grammars.prepare(params)  # its grammar compiles off the loop; the request waits here for it
        hashes = self.engine.pool.prompt_hashes(prompt_token_ids)  # on the caller's thread, not the loop
        stream = self.submit(request_id, lambda: self.engine.add_request(prompt_token_ids, params, request_id,
                                                                          hold_state, on_held, bounded=True,
                                                                          block_hashes=hashes))
        yield from self.iterate(request_id, stream)

    def iterate(self, request_id: str, stream: queue.Queue[RequestOutput | BaseException]) -> Iterator[RequestOutput]:
        """Outputs from a stream until the finished one; closes the stream (and aborts the request if the
        consumer stops early)."""
        finished = False
        try:
            while True:
                try:
                    item = _latest(stream, stream.get(timeout=1.0))
                except queue.Empty:
                    if self._stop.is_set():  # the loop is gone: nothing will come (a handler must not hang)
                        raise RuntimeError(f"the engine loop stopped before request {request_id} finished") from None
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished:
                self.post(lambda: self.engine.abort(request_id))

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- the loop thread -----------------------------------------------------------------------
    def _run_calls(self, block: bool) -> None:
        try:
            fn, future = self._calls.get(timeout=_IDLE_WAIT_S) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            if future is None:  # posted: nobody waits for it
                try:
                    fn()
                except Exception:
                    logger.exception("call posted to the engine loop failed")
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return

    def _fail_calls(self) -> None:
        """The loop is ending: a call still queued fails instead of leaving its caller (a gRPC handler thread,
        which the interpreter joins at exit) waiting for ever."""
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine loop stopped"))

    def _hand_off(self) -> None:
        """Put the held outputs into their requests' streams (a stream closed meanwhile drops its output)."""
        outputs, self._pending = self._pending, []
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                target.put(out)

    def _run_overlap_tasks(self, idle: bool) -> None:
        for task in self._overlap_tasks:
            try:
                task(idle)
            except Exception:
                logger.exception("overlap task %r failed", task)

    def _while_forward_runs(self) -> None:
        """The engine's on_launched: the GPU computes the step just queued."""
        self._run_overlap_tasks(False)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._fail_calls()
            self._hand_off()
            if self.profiler is not None:
                self.profiler.finish()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_calls(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                self._run_overlap_tasks(True)  # late hand-off's last outputs among them (without it none are held)
                self.stats.idle()
                continue
            start = time.perf_counter()
            self._step_started = time.monotonic()
            try:
                with self.profiler.step() if self.profiler is not None else contextlib.nullcontext():
                    outputs = self.engine.step(on_launched=self._while_forward_runs)
            except Exception as exc:  # a failed step fails the requests in it, not the worker
                self._step_started = None
                logger.exception("engine step failed")
                self._hand_off()  # the step before it completed: its outputs go out before the error
                for request_id, stream in list(self._streams.items()):
                    stream.put(RuntimeError(f"engine step failed: {exc}"))
                    self.engine.abort(request_id)
                self.stats.idle()
                if isinstance(exc, RankError):  # ... unless a tensor-parallel rank is gone: no step can run again
                    self.fatal = exc
                    self._stop.set()  # calls now fail at once (health too), and the worker process exits
                continue
            stepped = time.perf_counter()
            self._step_started = None
            self._hand_off()  # the previous step's outputs, where this step queued no forward
            self._pending = list(outputs)
            # an async step returns the previous step's outputs once the next step is already launched: they go out
            # now, while the GPU computes it (holding them to the next launch would delay every token by a step); a
            # step that ran synchronously (logprobs, grammars) leaves nothing in flight and hands off late
            if not (self.late_handoff and self.engine.has_unfinished()) or self.engine.step_in_flight:
                self._hand_off()  # no next step to overlap with: now
            self.stats.record(start, stepped, len(outputs), self.engine.last_step)


def _latest(
    stream: queue.Queue[RequestOutput | BaseException], item: RequestOutput | BaseException
) -> RequestOutput | BaseException:
    """The newest of `item` and the outputs already queued behind it: an output holds every token so far, so
    a consumer that fell behind (many streams, one GIL) sends what accumulated in one message instead of one per
    step. Stops at a finished output or an error, which must not be skipped."""
    while not isinstance(item, BaseException) and not item.finished:
        try:
            item = stream.get_nowait()
        except queue.Empty:
            break
    return item
