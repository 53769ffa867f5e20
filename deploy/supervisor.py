"""`serve --no-ray`: the worker processes of one deployment, started together and restarted when they die.

What Ray's `max_restarts` does for actors, for plain processes: a worker that exits while the deployment runs
(a crash, the OOM killer, a SIGKILL) is started again after a backoff (1 s, doubling up to 30 s; reset once a
worker has stayed up for a minute), on the same ports when the deployment fixed them. `addresses()` lists only
live, ready workers, so the router drops a dead worker and adds its successor when it serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridserve.deploy.launch import PendingWorker, WorkerProcess, WorkerStartError, stop_process, wait_ready

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a worker up this long before it died starts its next backoff from BACKOFF_FIRST_S


@dataclass(frozen=True)
class WorkerSpec:
    """What it takes to (re)start one worker: its role and id; `spawn` starts its process."""

    role: str
    worker_id: str
    spawn: Callable[[], PendingWorker]


class ProcessSupervisor:
    """Owns the worker processes: starts them all (in parallel), restarts the dead, stops them all."""

    def __init__(self, specs: list[WorkerSpec], ready_timeout_s: float) -> None:
        self._specs = {spec.worker_id: spec for spec in specs}
        self._ready_timeout_s = ready_timeout_s
        self._lock = threading.Lock()
        self._running: dict[str, WorkerProcess] = {}
        self._started_at: dict[str, float] = {}
        self._pending: dict[str, PendingWorker] = {}  # restarts not yet ready
        self._failures: dict[str, int] = {}
        self._restarting: set[str] = set()
        self._stopping = threading.Event()
        self.restarts = 0  # how many restarts succeeded (tests, logs)

    def start(self) -> None:
        """Spawn every worker, then wait until all serve (`wait_ready` stops them all if one fails)."""
        pending: list[PendingWorker] = []
        try:
            for spec in self._specs.values():
                pending.append(spec.spawn())
        except BaseException:
            for p in pending:
                stop_process(p.process)
                p.cleanup()
            raise
        with self._lock:
            self._pending = {p.worker_id: p for p in pending}
        ready = wait_ready(pending, self._ready_timeout_s)
        now = time.monotonic()
        with self._lock:
            self._pending.clear()
            for process in ready:
                self._running[process.worker_id] = process
                self._started_at[process.worker_id] = now

    def processes(self) -> list[WorkerProcess]:
        with self._lock:
            return list(self._running.values())

    def addresses(self) -> tuple[list[str], list[str]]:
        """gRPC addresses of the live, ready workers: (prefill, decode)."""
        live = [p for p in self.processes() if p.alive()]
        return ([p.address for p in live if p.role == "prefill"], [p.address for p in live if p.role == "decode"])

    def check(self) -> None:
        """Restart (on a thread of its own, after its backoff) every worker that has exited."""
        if self._stopping.is_set():
            return
        now = time.monotonic()
        with self._lock:
            dead = [p for p in self._running.values() if not p.alive()]
            for process in dead:
                del self._running[process.worker_id]
                if now - self._started_at.get(process.worker_id, now) > STABLE_AFTER_S:
                    self._failures[process.worker_id] = 0
                self._restarting.add(process.worker_id)
        for process in dead:
            delay = self._backoff(process.worker_id)
            logger.warning("%s worker %s (pid %d) exited with %s: restarting it in %.0f s (log: %s)", process.role,
                           process.worker_id, process.process.pid, process.process.returncode, delay, process.log_path)
            if process.process.stdin is not None:
                process.process.stdin.close()
            threading.Thread(target=self._restart, args=(process.worker_id, delay), daemon=True,
                             name=f"restart-{process.worker_id}").start()

    def _backoff(self, worker_id: str) -> float:
        failures = self._failures.get(worker_id, 0)
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** failures)

    def _restart(self, worker_id: str, delay: float) -> None:
        spec = self._specs[worker_id]
        while not self._stopping.wait(delay):
            self._failures[worker_id] = self._failures.get(worker_id, 0) + 1
            try:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    pending = self._pending[worker_id] = spec.spawn()
                process = wait_ready([pending], self._ready_timeout_s)[0]
            except WorkerStartError as exc:
                if self._stopping.is_set():
                    return
                delay = self._backoff(worker_id)
                logger.warning("restarting %s failed (%s): next try in %.0f s", worker_id, exc, delay)
                continue
            finally:
                with self._lock:
                    self._pending.pop(worker_id, None)
            with self._lock:
                if self._stopping.is_set():
                    stop_process(process.process)
                    return
                self._running[worker_id] = process
                self._started_at[worker_id] = time.monotonic()
                self._restarting.discard(worker_id)
                self.restarts += 1
            print(f"hybridserve: {spec.role} worker {worker_id} is back, serving on {process.address}", flush=True)
            return

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every worker (they drain), SIGKILL the ones still up after `timeout_s`; pending restarts end."""
        self._stopping.set()
        with self._lock:
            running, pending = list(self._running.values()), list(self._pending.values())
            self._running.clear()
        for process in running:
            if process.alive():
                process.process.terminate()
        for p in pending:
            stop_process(p.process)
            p.cleanup()
        for process in running:
            stop_process(process.process, timeout_s)
