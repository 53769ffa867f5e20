"""Faults under load, shared by the chaos test (tests/deploy/test_chaos.py, a short storm) and the soak
(bench/system/soak.py, 30 minutes): a router over in-process workers (the test cluster) plus decode workers as real
processes (for SIGKILL / SIGSTOP), a steady streaming load over HTTP, and the faults it injects.

Every request's outcome is one of: "exact" (the tokens of an undisturbed greedy run), "error" (a clean error:
an HTTP status with an OpenAI body, or an in-band error event), "disconnected" (the client left on purpose);
anything else ("wrong" tokens, a broken connection, a hang) is a failure of the system under test.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from router_cluster import MODEL_NAME, Cluster

from hybridserve.deploy.launch import WorkerProcess, start_worker_process
from hybridserve.deploy.options import WorkerOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2
from hybridserve.router.config import OrchestratorConfig, ResilienceConfig

MAX_TOKENS = 24
ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=16, max_model_len=256)
# short deadlines so that a stopped worker costs seconds, not minutes
RESILIENCE = ResilienceConfig(reserve_timeout_s=3.0, prefill_timeout_s=20.0, stream_timeout_s=60.0, control_timeout_s=2.0,
                              breaker_reset_s=2.0, health_interval_s=0.25, capacity_wait_s=10.0)
TOKEN = "chaos-internal-token-" + "x" * 16


@dataclass
class Outcomes:
    """Counts of request outcomes, and the details of the bad ones."""

    counts: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            self.counts[kind] += 1
            if kind not in ("exact", "error", "disconnected"):
                self.bad.append(f"{kind}: {detail}")


class ChaosSystem:
    """In-process prefill workers and one decode worker, two decode worker processes, and a router."""

    def __init__(self, model_dir: Path, num_prefill: int = 2) -> None:
        self.model_dir = model_dir
        self.cluster = Cluster(model_dir, num_prefill=num_prefill, num_decode=1, engine=ENGINE, internal_token=TOKEN,
                               orchestrator=OrchestratorConfig(resilience=RESILIENCE))
        self.options = WorkerOptions(str(model_dir), ENGINE, internal_token=TOKEN, drain_timeout_s=5.0)
        self.processes: list[WorkerProcess] = []
        self.prompts = [[random.Random(i).randrange(1, 300) for _ in range(8 + 5 * i)] for i in range(6)]
        self.expected: dict[int, list[int]] = {}

    def start_decode_process(self, worker_id: str) -> WorkerProcess:
        process = start_worker_process("decode", worker_id, self.options)
        self.processes.append(process)
        self.route()
        return process

    def route(self) -> None:
        """Route to every live worker (the in-process ones and the processes that run)."""
        prefill = [w.address for w in self.cluster.prefill if w._server is not None]
        decode = [w.address for w in self.cluster.decode] + [p.address for p in self.processes if p.alive()]
        self.cluster.router.update_workers(prefill, decode)
        self.cluster.wait_ready()

    @property
    def url(self) -> str:
        return self.cluster.base_url + "/v1/completions"

    def reference(self) -> None:
        """The undisturbed greedy tokens of every prompt (also warms the workers)."""
        for i, prompt in enumerate(self.prompts):
            self.expected[i] = self.request(i)[1]

    def request(self, i: int, leave_after: int | None = None) -> tuple[str, list[int]]:
        """One streaming request of prompt i; (outcome, tokens)."""
        body = {"model": MODEL_NAME, "prompt": self.prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        tokens: list[int] = []
        with httpx.stream("POST", self.url, json=body, timeout=httpx.Timeout(90.0)) as response:
            if response.status_code != 200:
                response.read()
                error = response.json().get("error", {})
                return ("error" if error.get("message") else "unclean-status"), tokens
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return ("error" if chunk["error"].get("message") else "unclean-event"), tokens
                for choice in chunk["choices"]:
                    tokens += choice.get("token_ids") or []
                if leave_after is not None and len(tokens) >= leave_after:
                    return "disconnected", tokens  # closing the stream here is the client going away
        return "done", tokens

    def load(self, stop: threading.Event, outcomes: Outcomes, seed: int) -> None:
        """One client: requests back to back until `stop`; every 7th leaves mid-stream."""
        rng = random.Random(seed)
        n = 0
        while not stop.is_set():
            i = rng.randrange(len(self.prompts))
            n += 1
            try:
                kind, tokens = self.request(i, leave_after=4 if n % 7 == 0 else None)
            except httpx.HTTPError as exc:
                outcomes.add("broken", f"prompt {i}: {type(exc).__name__}: {exc}")
                continue
            if kind == "done":
                kind = "exact" if tokens == self.expected[i] else "wrong"
            outcomes.add(kind, f"prompt {i}: {tokens} vs {self.expected[i]}")

    # ---- faults ----------------------------------------------------------------------------------
    def kill_decode_process(self) -> None:
        victim = next(p for p in self.processes if p.alive())
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=30)

    def kill_prefill(self) -> None:
        """An in-process prefill worker's server goes away at once (what SIGKILL looks like to its peers)."""
        victim = next(w for w in self.cluster.prefill if w._server is not None)
        victim._server.stop(0).wait()
        victim._server = None

    def stop_process_for(self, seconds: float) -> None:
        victim = next(p for p in self.processes if p.alive())
        os.kill(victim.process.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(victim.process.pid, signal.SIGCONT)

    def corrupt_next_transfer(self) -> threading.Event:
        """Flip a byte in the middle of the next gRPC state chunk a live prefill worker sends; returns an
        event set once that happened."""
        import hybridserve.transfer.sender as sender_module

        original = sender_module.encode_state_streams
        done = threading.Event()

        def corrupting(*args, **kwargs):
            streams = original(*args, **kwargs)
            if done.is_set():
                return streams

            def flip(stream):
                for k, item in enumerate(stream):
                    if k == 1 and isinstance(item, bytes) and len(item) > 64 and not done.is_set():
                        middle = len(item) // 2
                        item = item[:middle] + bytes([item[middle] ^ 0xFF]) + item[middle + 1:]
                        done.set()
                        sender_module.encode_state_streams = original
                    yield item

            return [flip(streams[0]), *streams[1:]]

        sender_module.encode_state_streams = corrupting
        return done

    # ---- after the storm -------------------------------------------------------------------------
    def settle(self, timeout: float = 30.0) -> list[str]:
        """Wait for every component to go idle; the problems left (pools, gauges, slots) as messages."""
        deadline = time.monotonic() + timeout
        router = self.cluster.router
        problems: list[str] = []
        while time.monotonic() < deadline:
            problems = []
            if router.frontend.admission.running or router.frontend.admission.queued:
                problems.append(f"router admission {router.frontend.admission.running} running")
            if router.orchestrator.num_in_flight():
                problems.append(f"router has {router.orchestrator.num_in_flight()} requests in flight")
            for w in self.cluster.prefill + self.cluster.decode:
                if w.loop.call(w.engine.has_unfinished):
                    problems.append(f"{w.worker_id} has unfinished requests")
            for handle in router.orchestrator.workers.all():
                if handle.address in {p.address for p in self.processes if p.alive()}:
                    h = handle.stub.Health(common_pb2.HealthRequest(), timeout=5)
                    if h.num_running or h.num_waiting or h.free_state_slots != h.total_state_slots:
                        problems.append(f"{handle.address}: {h.num_running} running, "
                                        f"{h.free_state_slots}/{h.total_state_slots} slots free")
            if not problems:
                break
            time.sleep(0.25)
        for w in self.cluster.prefill + self.cluster.decode:
            try:
                w.loop.call(w.engine.pool.check)
            except Exception as exc:  # the pool invariants do not hold
                problems.append(f"{w.worker_id} pool: {exc}")
        gauges = router.metrics
        for name in ("running", "queued"):
            value = getattr(gauges, name)._value.get()
            if value:
                problems.append(f"router gauge {name} = {value}")
        return problems

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of this process (router + in-process workers) and of every worker process."""
        pids = {"router+inproc": os.getpid(), **{p.worker_id: p.process.pid for p in self.processes if p.alive()}}
        out = {}
        for name, pid in pids.items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                out[name] = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024
            except (OSError, StopIteration):
                continue
        return out

    def stop(self) -> None:
        for p in self.processes:
            if p.alive():
                os.kill(p.process.pid, signal.SIGCONT)
            p.kill()
        self.cluster.stop()  # a killed in-process prefill worker has no server left to stop


def storm(system: ChaosSystem, outcomes: Outcomes, clients: int = 4, pause_s: float = 3.0,
          stop_s: float = 10.0, log=print) -> None:
    """One round of every fault, in turn, under `clients` streaming clients."""
    stop = threading.Event()
    threads = [threading.Thread(target=system.load, args=(stop, outcomes, seed), daemon=True) for seed in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(pause_s)
        log("fault: SIGKILL a decode worker process")
        system.kill_decode_process()
        time.sleep(pause_s)
        log("fault: a prefill worker dies")
        system.kill_prefill()
        time.sleep(pause_s)
        log(f"fault: SIGSTOP a decode worker process for {stop_s:.0f} s")
        system.stop_process_for(stop_s)
        time.sleep(pause_s)
        log("fault: corrupt a state transfer")
        corrupted = system.corrupt_next_transfer()
        corrupted.wait(timeout=20)
        time.sleep(pause_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
