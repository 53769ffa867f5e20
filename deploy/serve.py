"""`hybridserve serve`: workers (Ray actors or plain processes) plus the router (HTTP + gRPC front doors),
until interrupted.

Everything that can be checked before a model loads is checked first (deploy/preflight.py); whatever has
started is stopped on every way out (an error, Ctrl-C or SIGTERM at any point); plain worker processes are
owned by this one (supervised, restarted when they die, and gone when it is).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridserve.deploy.gpu_placement import assign_gpu_groups, host_gpus, visible_devices
from hybridserve.deploy.launch import WorkerPorts, spawn_worker_process
from hybridserve.deploy.options import ServeOptions, new_internal_token
from hybridserve.deploy.preflight import check_gpus, check_model_dir, check_ports_free
from hybridserve.deploy.process_heap import freeze_startup_heap
from hybridserve.deploy.ray_head import RayHead
from hybridserve.deploy.supervisor import ProcessSupervisor, WorkerSpec
from hybridserve.proto.channels import is_loopback
from hybridserve.router.app import Router

__all__ = ["Deployment", "ServeOptions", "preflight", "serve"]

logger = logging.getLogger(__name__)

ADDRESS_REFRESH_S = 2.0
SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


def _worker_ids(options: ServeOptions) -> list[tuple[str, str]]:
    """(role, worker id) of every worker, in start order (prefill first): worker i's ports are base + 3i.."""
    return [(role, f"{role}-{i}") for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode))
            for i in range(count)]


def preflight(options: ServeOptions) -> None:
    """What `serve` checks before it starts anything: PreflightError (one line, what to change) on the first
    that fails."""
    check_model_dir(options.worker.model_dir)
    router = options.router
    check_ports_free(router.host, [(router.http_port or 0, "--port"), (router.grpc_port or 0, "--grpc-port")])
    if options.worker_port_base:
        worker_host = "0.0.0.0" if options.worker.host == "node-ip" else options.worker.host
        ports = [(port, f"--worker-port-base ({wid})") for i, (_, wid) in enumerate(_worker_ids(options))
                 for port in (WorkerPorts.from_base(options.worker_port_base, i).grpc,
                              WorkerPorts.from_base(options.worker_port_base, i).session,
                              WorkerPorts.from_base(options.worker_port_base, i).metrics)]
        check_ports_free(worker_host, ports)
    if not options.use_ray:
        wants_gpu = options.worker.engine.device.startswith("cuda") or options.num_gpus_per_worker > 0
        sizes = sum(options.worker_for(role).engine.tensor_parallel_size for role, _ in _worker_ids(options))
        if wants_gpu:
            check_gpus(1 if options.gpus or sizes <= 1 else sizes, len(host_gpus(dict(os.environ))),
                       f"--device {options.worker.engine.device}")
    elif options.ray_address:
        from hybridserve.deploy.preflight import check_ray_reachable

        check_ray_reachable(options.ray_address)
    else:  # the local Ray head's ports (those given) are free
        head = options.ray_head
        check_ports_free("0.0.0.0", [(getattr(head, f.name), f"--ray-{f.name.replace('_', '-')}")
                                     for f in dataclasses.fields(head) if "worker_port" not in f.name])


class Deployment:
    """Running workers and a way to re-read their addresses (Ray restarts move them; --no-ray restarts too)."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.supervisor: ProcessSupervisor | None = None
        self._actors: dict[str, list] = {}
        self.log_dir: Path | None = None
        self.ray_head: RayHead | None = None  # the local head a bare Ray `serve` started

    def start(self) -> None:
        """Start the workers and wait until they serve (bounded by options.timeout_s); on failure the caller's
        stop() ends what started."""
        if self.options.use_ray:
            self._start_ray()
        else:
            self._start_processes()

    def _start_processes(self) -> None:
        options = self.options
        role_options = {role: options.worker_for(role) for role in ("prefill", "decode")}
        workers = _worker_ids(options)
        gpus = host_gpus(dict(os.environ)) if options.worker.engine.device.startswith("cuda") else []
        sizes = {wid: role_options[role].engine.tensor_parallel_size for role, wid in workers}
        placement = assign_gpu_groups([wid for _, wid in workers], len(gpus), sizes, options.gpus)
        for wid, group in placement.items():
            print(f"hybridserve: {wid} on GPU {','.join(gpus[g] for g in group)}", flush=True)
        self.log_dir = Path(options.log_dir) if options.log_dir else Path(tempfile.mkdtemp(prefix="hybridserve-logs-"))
        print(f"hybridserve: worker logs in {self.log_dir}", flush=True)
        specs = []
        for index, (role, wid) in enumerate(workers):
            env = {"CUDA_VISIBLE_DEVICES": visible_devices(placement[wid], gpus)} if wid in placement else None
            ports = WorkerPorts.from_base(options.worker_port_base, index)

            def spawn(role: str = role, wid: str = wid, env: dict | None = env, ports: WorkerPorts = ports):  # noqa: ANN202
                return spawn_worker_process(role, wid, role_options[role], ports, env=env, log_dir=self.log_dir)

            specs.append(WorkerSpec(role, wid, spawn))
        self.supervisor = ProcessSupervisor(specs, options.timeout_s)
        self.supervisor.start()

    def _start_ray(self) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ValueError("Ray is not installed: `pip install ray`, or pass --no-ray for plain processes") from exc

        from hybridserve.deploy.ray_workers import (
            RayPlacement,
            actor_addresses,
            check_cluster,
            connect,
            start_ray_workers,
        )

        o = self.options
        workers = o.num_prefill + o.num_decode
        address = o.ray_address
        if not address:  # a local head of our own, on the ports given, offering the custom resources the actors
            # ask for and a CPU for each of them
            self.ray_head = RayHead.start(o.ray_head, {"prefill": o.num_prefill, "decode": o.num_decode},
                                          max(os.cpu_count() or 1, workers), o.timeout_s)
            address = self.ray_head.address
            print(f"hybridserve: local Ray head at {address} (its log: {self.ray_head.log_path})", flush=True)
        connect(address, o.timeout_s, "hybridserve")
        check_cluster(o, o.num_gpus_per_worker)
        self._actors = start_ray_workers(o, RayPlacement(num_gpus=o.num_gpus_per_worker, ready_timeout_s=o.timeout_s))
        actor_addresses(self._actors["prefill"] + self._actors["decode"], timeout=o.timeout_s)

    def check(self) -> None:
        """Restart dead worker processes (Ray restarts its actors itself)."""
        if self.supervisor is not None:
            self.supervisor.check()

    def addresses(self) -> tuple[list[str], list[str]]:
        if self._actors:
            from hybridserve.deploy.ray_workers import actor_addresses

            return actor_addresses(self._actors["prefill"]), actor_addresses(self._actors["decode"])
        return self.supervisor.addresses() if self.supervisor is not None else ([], [])

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._actors:
            import ray

            for actor in self._actors["prefill"] + self._actors["decode"]:
                ray.kill(actor, no_restart=True)
            self._actors = {}
        if self.ray_head is not None:
            import ray

            ray.shutdown()  # this driver leaves the cluster before its head goes
            self.ray_head.stop()
            self.ray_head = None


def send_requests_line(grpc_address: str | None, http_address: str | None) -> str:
    """The banner's last line: where to send requests, ending with the OpenAI HTTP URL (what most clients take)."""
    doors = [f"grpc://{grpc_address} (hybridserve.v1.Router/Generate)"] if grpc_address else []
    if http_address:
        doors.append(f"the OpenAI API at http://{http_address}/v1")
    return "send requests to " + " or ".join(doors)


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While starting: SIGINT and SIGTERM raise KeyboardInterrupt (its argument names the signal), so every
    start-up step unwinds through the clean-up. Main thread only (signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(SIGNAL_NAMES.get(signal.Signals(signum), str(signum)))

    previous = {sig: signal.signal(sig, interrupt) for sig in SIGNAL_NAMES}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(options: ServeOptions, stop: threading.Event | None = None) -> int:
    """Check, start everything, print the endpoints, serve until SIGINT / SIGTERM (or `stop` is set)."""
    preflight(options)
    if options.worker.internal_token is None and options.secure_internal:
        options = options.with_internal_token(new_internal_token())
    if not is_loopback(options.worker.host) and not options.worker.internal_tls.enabled:
        insecure = "no internal token, " if options.worker.internal_token is None else ""
        print(f"hybridserve: workers bind {options.worker.host} with {insecure}plaintext internal gRPC: pass "
              "--internal-tls-ca-file/-cert-file/-key-file beyond a trusted network", flush=True)
    router_options = options.router
    deployment = Deployment(options)
    router: Router | None = None
    with _signals_interrupt():
        try:
            deployment.start()
            prefill, decode = deployment.addresses()
            router = Router(router_options, prefill, decode)
            if threading.current_thread() is threading.main_thread():
                # after the router is built, before its doors open: a full collection of the start-up heap
                # (80-250 ms with the GIL held) must not meet the first request
                freeze_startup_heap("router")  # this process serves the router from here to its end
            router.start()
        except BaseException:
            if router is not None:
                try:
                    router.stop()
                except Exception:  # half started: stop what did start, report the first failure
                    logger.debug("router stop after a failed start", exc_info=True)
            deployment.stop()
            raise
    print(f"hybridserve: {len(prefill)} prefill and {len(decode)} decode workers ready", flush=True)
    print(f"hybridserve: serving model {router_options.served_name!r}", flush=True)
    for line in router.endpoints():
        print(f"hybridserve: {line}", flush=True)
    print(f"hybridserve: {send_requests_line(router.grpc_address, router.http_address)}", flush=True)
    received: list[str] = []
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum: int, _frame: object) -> None:
            received.append(SIGNAL_NAMES.get(signal.Signals(signum), str(signum)))
            # set from a thread: Event.set() in the handler deadlocks when the signal lands while this thread
            # holds the Event's lock inside stop.wait()
            threading.Thread(target=stop.set).start()

        for sig in SIGNAL_NAMES:
            signal.signal(sig, on_signal)
    while not stop.wait(ADDRESS_REFRESH_S):
        try:
            deployment.check()
            prefill, decode = deployment.addresses()
            if decode:  # none alive (restarting): keep the old handles; health marks them unreachable
                router.update_workers(prefill, decode)
        except Exception as exc:  # a worker restarting: keep the old addresses until it is back
            logger.warning("could not refresh worker addresses: %s", exc)
    why = received[0] if received else "stop requested"
    print(f"hybridserve: draining ({why}): readiness is false, in-flight requests finish", flush=True)
    router.drain()
    router.stop()
    deployment.stop()
    print("hybridserve: stopped", flush=True)
    return 0
