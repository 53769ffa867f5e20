"""Rank 0 watches its spawned follower ranks: a follower that exits (at start-up, in the rendezvous or during
any collective) surfaces on rank 0 within a bounded time as a RankError naming its rank, exit status and last
error, instead of a wait on a peer that will never answer. A follower that is alive but stopped or wedged (its
heartbeat, a shared counter a thread of it bumps, stands still past the hang timeout) is ended (SIGKILL, so
the collective rank 0 waits in fails at once) and named the same way.

A thread polls the follower processes. The rendezvous runs beside that poll, so a follower that dies before
joining (e.g. a spawned process that cannot re-import a script read from standard input) fails the start at
once; a collective that errors because its peer's socket closed (gloo does at once) is re-raised as the
follower's RankError; under NCCL, whose collectives wait out their timeout, the watch aborts the process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.2
START_TIMEOUT_S = 300.0  # the rendezvous: every follower process started and joined the group
EXIT_GRACE_S = 2.0  # a collective failed: how long a dying follower's exit status may take to show
HEARTBEAT_S = 0.5  # how often a follower bumps its heartbeat


class RankError(RuntimeError):
    """A tensor-parallel follower rank is gone: the group cannot run another collective."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def start_heartbeat(counter: Any, period_s: float = HEARTBEAT_S) -> None:
    """In a follower: bump `counter` (a shared multiprocessing.Value) every `period_s` from a daemon thread, for
    as long as the process runs (a stopped process, or one whose interpreter is wedged, stops bumping it)."""

    def beat() -> None:
        while True:
            counter.value += 1
            time.sleep(period_s)

    threading.Thread(target=beat, daemon=True, name="tp-heartbeat").start()


class RankWatch:
    """Watches follower processes (multiprocessing.Process) whose last errors arrive on `errors` as
    (rank, message), and their `heartbeats` (one shared counter each, None: exits only): a counter that has
    moved once and then stands still for `hang_timeout_s` marks its follower hung."""

    def __init__(self, processes: list[Any], errors: Any, backend: str, heartbeats: list[Any] | None = None,
                 hang_timeout_s: float = 30.0) -> None:
        self._processes = processes  # process i is rank i + 1
        self._errors = errors
        self._backend = backend
        self._heartbeats = heartbeats
        self._hang_timeout_s = hang_timeout_s
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter value, when it last moved)
        self._last_error: dict[int, str] = {}
        self._joining: set[int] = set()
        self._failure: RankError | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tp-rank-watch", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> RankError | None:
        return self._failure

    def stop(self) -> None:
        """The group is shutting down: a follower's exit from here on is expected."""
        self._stopped.set()

    def _check(self) -> RankError | None:
        with self._lock:
            if self._failure is not None or self._stopped.is_set():
                return self._failure
            while not self._errors.empty():
                rank, message = self._errors.get()
                if message:
                    self._last_error[rank] = message
                else:  # started: about to join the group
                    self._joining.add(rank)
            for rank, process in enumerate(self._processes, start=1):
                if process.exitcode is None:
                    continue
                last = self._last_error.get(rank) or (
                    "it reported no Python error (killed, or it died before running: a spawned process re-imports "
                    "the main script, which fails for a script read from standard input)")
                self._failure = RankError(f"tensor-parallel rank {rank} (pid {process.pid}) "
                                          f"{describe_exit(process.exitcode)}; its last error: {last}")
                logger.error("%s", self._failure)
                return self._failure
            return self._check_heartbeats()

    def _check_heartbeats(self) -> RankError | None:
        """A follower whose heartbeat stood still past the hang timeout: ended, and its RankError (lock held)."""
        if self._heartbeats is None:
            return None
        now = time.monotonic()
        for rank, (counter, process) in enumerate(zip(self._heartbeats, self._processes), start=1):
            value = counter.value
            last = self._beats.get(rank)
            if last is None or value != last[0]:
                self._beats[rank] = (value, now)
                continue
            if value == 0 or now - last[1] < self._hang_timeout_s:  # not started beating yet / within the limit
                continue
            self._failure = RankError(
                f"tensor-parallel rank {rank} (pid {process.pid}) is alive but has shown no sign of life for "
                f"{now - last[1]:.1f} s (stopped or hung; tensor_parallel_hang_timeout_s="
                f"{self._hang_timeout_s:g}); it was ended")
            logger.error("%s", self._failure)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)  # a stopped process still takes SIGKILL: its sockets close
            return self._failure
        return None

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            if self._check() is not None:
                self._abort_group()
                return

    def _abort_group(self) -> None:
        """Unblock rank 0 from a collective that would wait out its timeout (NCCL); gloo errors by itself."""
        if self._backend != "nccl":
            return
        import torch.distributed as dist

        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            try:
                abort()
            except Exception:  # best effort: the collective still ends at its timeout
                logger.exception("aborting the tensor-parallel process group failed")

    def rendezvous(self, init: Callable[[], None], timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every follower is about to join the group (it says so on `errors` with an empty message),
        then run `init` (rank 0's init_process_group, which cannot be interrupted) with the collective checks:
        RankError as soon as a follower exits, or when they are not all ready within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            failure = self._check()
            if failure is not None:
                self._end_followers()
                raise failure
            with self._lock:
                if len(self._joining) == len(self._processes):
                    break
            if time.monotonic() > deadline:
                self._end_followers()
                raise RankError(f"the tensor-parallel followers did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
        with self.checked():
            init()

    def _end_followers(self) -> None:
        self._stopped.set()
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()

    @contextlib.contextmanager
    def checked(self) -> Iterator[None]:
        """Re-raise an error of the block as the follower's RankError when a follower died (waiting up to
        EXIT_GRACE_S for its exit to show: the collective can fail before the process is reaped)."""
        if self._failure is not None:
            raise self._failure
        try:
            yield
        except Exception as exc:
            deadline = time.monotonic() + EXIT_GRACE_S
            failure = self._check()
            while failure is None and time.monotonic() < deadline and not self._stopped.is_set():
                time.sleep(0.05)
                failure = self._check()
            if failure is not None:
                raise failure from exc
            raise
