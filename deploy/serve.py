"""`hybridserve serve`: workers (Ray actors or plain processes) plus the router (HTTP + gRPC front doors),
until interrupted."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.deploy.gpu_placement import assign_gpus, host_gpus, visible_devices
from hybridserve.deploy.launch import WorkerOptions, start_worker_process
from hybridserve.engine.config import EngineConfig
from hybridserve.router.app import Router, RouterOptions
from hybridserve.router.config import AdmissionConfig, OrchestratorConfig
from hybridserve.transfer.planes import TransferConfig

logger = logging.getLogger(__name__)

ADDRESS_REFRESH_S = 2.0


@dataclass(frozen=True)
class ServeOptions:
    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    ray_address: str | None = None
    use_ray: bool = True
    num_gpus_per_worker: float = 0.0
    local_prefill_max_tokens: int = 0
    http_port: int | None = 8000
    model_name: str | None = None
    max_running: int = 256
    max_queued: int = 512
    transfer: TransferConfig = field(default_factory=TransferConfig)
    gpus: str | None = None  # --gpus placement (deploy/gpu_placement.py); None: round-robin on a multi-GPU host
    # EngineConfig fields that differ for prefill workers (e.g. {"prefill_chunk_size": 4096}: a prefill worker
    # runs no decodes, so big chunks cost no inter-token latency); validated by EngineConfig itself
    prefill_engine_overrides: dict | None = None
    # where worker processes (--no-ray) write their logs, <worker-id>.log each; None: a fresh temporary
    # directory. The banner names it, so a failed worker's cause is one `tail` away.
    log_dir: str | None = None
    api_key: str | None = None  # clients must send it (Authorization: Bearer) on /v1 and gRPC calls

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("serve needs --decode-workers >= 1 and --prefill-workers >= 0")
        self.engine_for("prefill")  # validates the overrides now, not in a worker process

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of a worker of `role` (prefill workers get their overrides)."""
        if role != "prefill" or not self.prefill_engine_overrides:
            return self.engine
        unknown = set(self.prefill_engine_overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"prefill worker overrides name no EngineConfig field: {sorted(unknown)}")
        return dataclasses.replace(self.engine, **self.prefill_engine_overrides)

    def router_options(self) -> RouterOptions:
        return RouterOptions(
            model_dir=self.model_dir, model_name=self.model_name, host=self.host, http_port=self.http_port,
            grpc_port=self.port, max_model_len=self.engine.max_model_len,
            orchestrator=OrchestratorConfig(local_prefill_max_tokens=self.local_prefill_max_tokens),
            admission=AdmissionConfig(max_running=self.max_running, max_queued=self.max_queued),
            api_key=self.api_key,
        )


class Deployment:
    """Running workers and a way to re-read their addresses (Ray restarts move them)."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self._processes = []
        self._actors: dict[str, list] = {}
        if options.use_ray:
            self._start_ray()
        else:
            role_options = {role: WorkerOptions(options.model_dir, options.engine_for(role), transfer=options.transfer)
                            for role in ("prefill", "decode")}
            workers = [(role, f"{role}-{i}") for role, count in (("prefill", options.num_prefill),
                                                                 ("decode", options.num_decode)) for i in range(count)]
            gpus = host_gpus(dict(os.environ)) if options.engine.device.startswith("cuda") else []
            placement = assign_gpus([wid for _, wid in workers], len(gpus), options.gpus)
            for wid, gpu in placement.items():
                print(f"hybridserve: {wid} on GPU {gpus[gpu]}", flush=True)
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
        self._actors = start_ray_workers(
            o.model_dir, o.engine, o.num_prefill, o.num_decode, RayPlacement(num_gpus=o.num_gpus_per_worker),
            o.transfer, prefill_engine=o.engine_for("prefill"),
        )

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
    router_options = options.router_options()
    deployment = Deployment(options)
    prefill, decode = deployment.addresses()
    router = Router(router_options, prefill, decode).start()
    print(f"hybridserve: {len(prefill)} prefill and {len(decode)} decode workers ready", flush=True)
    print(f"hybridserve: serving model {router_options.served_name!r}", flush=True)
    for line in router.endpoints():
        print(f"hybridserve: {line}", flush=True)
    if router.grpc_address:
        print(f"hybridserve: send requests to grpc://{router.grpc_address} (hybridserve.v1.Router/Generate)", flush=True)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(ADDRESS_REFRESH_S):
        try:
            router.update_workers(*deployment.addresses())
        except Exception as exc:  # a worker restarting: keep the old addresses until it is back
            logger.warning("could not refresh worker addresses: %s", exc)
    router.stop()
    deployment.stop()
    return 0
