"""The deployment's configuration as one chain of frozen, validated dataclasses, passed whole.

    ServeOptions / UpOptions  (how many workers, where: local processes, Ray, a Ray cluster)
      └── ClusterOptions      (what `serve` and `up` share)
            ├── router: RouterOptions    (the front doors, routing, admission; router/config.py)
            └── worker: WorkerOptions    (every worker's engine and transfer config, bind host, token)
                  ├── engine: EngineConfig
                  └── transfer: TransferConfig

Every field is defined once; what two parts must agree on (the checkpoint, the internal token, the context
length) is checked or filled in here, not re-typed.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from typing import TypeVar

from hybridserve.common.config_flags import config_argv, from_jsonable, to_jsonable
from hybridserve.deploy.ray_head import RayHeadOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.router.config import RouterOptions
from hybridserve.transfer.planes import TransferConfig

_Cluster = TypeVar("_Cluster", bound="ClusterOptions")

NODE_IP = "node-ip"  # WorkerOptions.host of Ray actors: bind the address of the node the actor runs on


@dataclass(frozen=True)
class WorkerOptions:
    """What every worker of a deployment shares: one process's whole configuration."""

    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    # the address the worker's gRPC server binds: 127.0.0.1 for one host; "node-ip" (Ray actors) the node's
    # own address; 0.0.0.0 only when asked
    host: str = "127.0.0.1"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # shared secret every internal gRPC call carries (router -> worker, worker -> worker); None: insecure
    internal_token: str | None = None
    # SIGTERM: seconds the requests in flight get to finish (new ones are refused) before they are aborted
    drain_timeout_s: float = 30.0
    # mutual TLS on internal gRPC (the worker's port and its channels to decode workers); the files must be at
    # these paths wherever a worker runs (a mounted Kubernetes Secret); empty: plaintext
    internal_tls: InternalTlsConfig = field(default_factory=InternalTlsConfig)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the worker host must be an address, 'node-ip' or 0.0.0.0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.internal_token is not None and len(self.internal_token) < 16:
            raise ValueError("the internal token must be at least 16 characters (or unset for insecure mode)")

    def config_json(self) -> str:
        """The worker's engine and transfer config as one JSON object (what `hybridserve worker --worker-config`
        takes and what the worker reports in Health.config_json; the token is not part of it)."""
        return json.dumps({"engine": to_jsonable(self.engine), "transfer": to_jsonable(self.transfer)}, sort_keys=True)

    def argv(self) -> list[str]:
        """The `hybridserve worker` flags of this config (the token travels in the environment, not argv)."""
        return ["--model", self.model_dir, "--host", self.host, "--drain-timeout", str(self.drain_timeout_s),
                "--worker-config", self.config_json(), *config_argv(self.internal_tls, prefix="internal-tls-")]


def configs_from_json(text: str) -> tuple[EngineConfig, TransferConfig]:
    """The (engine, transfer) configs of a `--worker-config` JSON object; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--worker-config is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"engine", "transfer"}:
        raise ValueError('--worker-config must be a JSON object with keys "engine" and "transfer"')
    return from_jsonable(EngineConfig, data.get("engine", {})), from_jsonable(TransferConfig, data.get("transfer", {}))


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """A router over prefill and decode workers: what `serve` and `up` share."""

    router: RouterOptions
    worker: WorkerOptions
    num_prefill: int = 1
    num_decode: int = 1
    # GPUs of a worker actor (Ray); a worker with tensor_parallel_size N > 1 and a value > 0 reserves N GPUs
    # on one node instead (a placement group, one bundle per rank, STRICT_PACK)
    num_gpus_per_worker: float = 0.0
    # EngineConfig fields that differ for prefill workers (e.g. {"prefill_chunk_size": 4096}: a prefill worker
    # runs no decodes, so big chunks cost no inter-token latency); validated by EngineConfig itself
    prefill_engine_overrides: dict | None = None
    # start-up deadline: Ray connection and placement, every worker ready (each wait says what is missing)
    timeout_s: float = 600.0
    # worker i (prefill workers first) binds gRPC / session / metrics ports base+3i .. base+3i+2; 0: free ports
    worker_port_base: int = 0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be > 0")
        if self.worker_port_base and not 1024 <= self.worker_port_base <= 65535 - 3 * (self.num_prefill + self.num_decode):
            raise ValueError(f"--worker-port-base {self.worker_port_base} leaves no room for "
                             f"{3 * (self.num_prefill + self.num_decode)} ports below 65536 (or is below 1024)")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a deployment needs --decode-workers >= 1 and --prefill-workers >= 0")
        if self.worker.engine.pd_multiplex and self.num_prefill > 0:
            raise ValueError("--pd-multiplex decode workers prefill their own prompts (in their prefill lane): "
                             "set --prefill-workers 0")
        if self.num_gpus_per_worker < 0:
            raise ValueError("--num-gpus-per-worker must be >= 0")
        if self.router.model_dir != self.worker.model_dir:
            raise ValueError(f"router and workers name different checkpoints: {self.router.model_dir!r} "
                             f"vs {self.worker.model_dir!r}")
        if self.router.internal_token != self.worker.internal_token:
            raise ValueError("router and workers must share one internal token")
        if self.router.internal_tls != self.worker.internal_tls:
            raise ValueError("router and workers must share one internal TLS config (CA, certificate, server name)")
        if self.router.max_model_len is None:  # the router's limit is the workers' engine limit
            object.__setattr__(self, "router",
                               dataclasses.replace(self.router, max_model_len=self.worker.engine.max_model_len))
        self.worker_for("prefill")  # validates the overrides now, not in a worker process

    def worker_for(self, role: str) -> WorkerOptions:
        """The options of a worker of `role`: prefill workers get their engine overrides; with prefill workers,
        every worker's unset `standby_state_slots` becomes its max_num_seqs (remote prefills run ahead of a full
        decode batch, finished states wait for their transfer outside the prefill batch)."""
        engine = self.worker.engine
        if role == "prefill" and self.prefill_engine_overrides:
            unknown = set(self.prefill_engine_overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
            if unknown:
                raise ValueError(f"prefill worker overrides name no EngineConfig field: {sorted(unknown)}")
            engine = dataclasses.replace(engine, **self.prefill_engine_overrides)
        if self.num_prefill > 0 and engine.standby_state_slots is None:
            engine = dataclasses.replace(engine, standby_state_slots=engine.max_num_seqs)
        return self.worker if engine is self.worker.engine else dataclasses.replace(self.worker, engine=engine)

    def with_internal_token(self: _Cluster, token: str | None) -> _Cluster:
        """The same options with `token` on both sides (serve generates one per run when none is given)."""
        return dataclasses.replace(self, router=dataclasses.replace(self.router, internal_token=token),
                                   worker=dataclasses.replace(self.worker, internal_token=token))


@dataclass(frozen=True, kw_only=True)
class ServeOptions(ClusterOptions):
    """`hybridserve serve`: workers on this host (Ray actors, or plain processes with use_ray=False)."""

    ray_address: str | None = None  # a Ray cluster to join; None: start a local one
    use_ray: bool = True
    # the ports of the local Ray head started without ray_address (deploy/ray_head.py)
    ray_head: RayHeadOptions = field(default_factory=RayHeadOptions)
    # --gpus placement (deploy/gpu_placement.py; a tensor-parallel worker's index is the first of its
    # contiguous GPUs); None: round-robin on a multi-GPU host, one contiguous GPU set per TP group
    gpus: str | None = None
    # where worker processes (--no-ray) write their logs, <worker-id>.log each; None: a fresh temporary
    # directory. The banner names it, so a failed worker's cause is one `tail` away.
    log_dir: str | None = None
    # generate an internal token for this run when none is given (False: insecure internal gRPC)
    secure_internal: bool = True


@dataclass(frozen=True, kw_only=True)
class UpOptions(ClusterOptions):
    """`hybridserve up`: detached actors on a running Ray cluster; the router's ports are on the head node."""

    address: str
    max_restarts: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")


def new_internal_token() -> str:
    """A fresh unguessable token (256 bits)."""
    return secrets.token_urlsafe(32)
