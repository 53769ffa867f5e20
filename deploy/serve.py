"""`hybridserve serve`: workers (Ray actors or plain processes) plus the router (HTTP + gRPC front doors),
until interrupted."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from pathlib import Path

from hybridserve.deploy.gpu_placement import assign_gpu_groups, host_gpus, visible_devices
from hybridserve.deploy.launch import WorkerProcess, start_worker_process
from hybridserve.deploy.options import ServeOptions, new_internal_token
from hybridserve.deploy.process_heap import freeze_startup_heap
from hybridserve.router.app import Router

__all__ = ["Deployment", "ServeOptions", "serve"]

logger = logging.getLogger(__name__)

ADDRESS_REFRESH_S = 2.0


class Deployment:
    """Running workers and a way to re-read their addresses (Ray restarts move them)."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self._processes: list[WorkerProcess] = []
        self._actors: dict[str, list] = {}
        if options.use_ray:
            self._start_ray()
        else:
            role_options = {role: options.worker_for(role) for role in ("prefill", "decode")}
            workers = [(role, f"{role}-{i}") for role, count in (("prefill", options.num_prefill),
                                                                 ("decode", options.num_decode)) for i in range(count)]
            gpus = host_gpus(dict(os.environ)) if options.worker.engine.device.startswith("cuda") else []
            sizes = {wid: role_options[role].engine.tensor_parallel_size for role, wid in workers}
            placement = assign_gpu_groups([wid for _, wid in workers], len(gpus), sizes, options.gpus)
            for wid, group in placement.items():
                print(f"hybridserve: {wid} on GPU {','.join(gpus[g] for g in group)}", flush=True)
            self.log_dir = Path(options.log_dir) if options.log_dir else Path(tempfile.mkdtemp(prefix="hybridserve-logs-"))
            print(f"hybridserve: worker logs in {self.log_dir}", flush=True)
            for role, wid in workers:
                env = {"CUDA_VISIBLE_DEVICES": visible_devices(placement[wid], gpus)} if wid in placement else None
                self._processes.append(start_worker_process(role, wid, role_options[role], env=env,
                                                            log_dir=self.log_dir))

    def _start_ray(self) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ValueError("Ray is not installed: `pip install ray`, or pass --no-ray for plain processes") from exc

        from hybridserve.deploy.ray_workers import RayPlacement, start_ray_workers

        o = self.options
        if not ray.is_initialized():
            if o.ray_address:
                ray.init(address=o.ray_address, namespace="hybridserve", log_to_driver=False)
            else:  # a local cluster that offers the custom resources the actors ask for
                ray.init(namespace="hybridserve", include_dashboard=False, log_to_driver=False,
                         resources={"prefill": o.num_prefill, "decode": o.num_decode})
        self._actors = start_ray_workers(o, RayPlacement(num_gpus=o.num_gpus_per_worker))

    def addresses(self) -> tuple[list[str], list[str]]:
        if self._actors:
            from hybridserve.deploy.ray_workers import actor_addresses

            return actor_addresses(self._actors["prefill"]), actor_addresses(self._actors["decode"])
        return (
            [p.address for p in self._processes if p.role == "prefill"],
            [p.address for p in self._processes if p.role == "decode"],
        )

    def stop(self) -> None:
        for process in self._processes:
            process.process.terminate()
        for process in self._processes:
            try:
                process.process.wait(timeout=30)
            except Exception:
                process.kill()
        if self._actors:
            import ray

            for actor in self._actors["prefill"] + self._actors["decode"]:
                ray.kill(actor, no_restart=True)


def serve(options: ServeOptions, stop: threading.Event | None = None) -> int:
    """Start everything, print the endpoints, serve until SIGINT / SIGTERM (or `stop` is set)."""
    if options.worker.internal_token is None and options.secure_internal:
        options = options.with_internal_token(new_internal_token())
    if options.worker.internal_token is None:
        print("hybridserve: internal gRPC is INSECURE (no token): any process that reaches a worker port can "
              "call it; use only on a trusted host", flush=True)
    if not options.worker.internal_tls.enabled:
        print(f"hybridserve: internal gRPC is PLAINTEXT (no --internal-tls-*): workers bind {options.worker.host}; "
              "give a CA, certificate and key for mutual TLS beyond 127.0.0.1", flush=True)
    router_options = options.router
    deployment = Deployment(options)
    prefill, decode = deployment.addresses()
    router = Router(router_options, prefill, decode)
    if threading.current_thread() is threading.main_thread():
        # after the router is built, before its doors open: a full collection of the start-up heap (80-250 ms
        # with the GIL held) must not meet the first request
        freeze_startup_heap("router")  # this process serves the router from here to its end
    router.start()
    print(f"hybridserve: {len(prefill)} prefill and {len(decode)} decode workers ready", flush=True)
    print(f"hybridserve: serving model {router_options.served_name!r}", flush=True)
    for line in router.endpoints():
        print(f"hybridserve: {line}", flush=True)
    if router.grpc_address:
        print(f"hybridserve: send requests to grpc://{router.grpc_address} (hybridserve.v1.Router/Generate)", flush=True)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=stop.set).start())  # not set() in the handler:
            # it deadlocks when the signal lands while this thread holds the Event's lock inside stop.wait()
    while not stop.wait(ADDRESS_REFRESH_S):
        try:
            router.update_workers(*deployment.addresses())
        except Exception as exc:  # a worker restarting: keep the old addresses until it is back
            logger.warning("could not refresh worker addresses: %s", exc)
    print("hybridserve: draining (SIGTERM): readiness is false, in-flight requests finish", flush=True)
    router.drain()
    router.stop()
    deployment.stop()
    return 0
