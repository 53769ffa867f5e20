"""The flag groups `serve` and `up` share (front doors, internal gRPC, engine and transfer configs) and the
configs built back from them: one definition for both commands."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

INTERNAL_TOKEN_ENV = "HYBRIDSERVE_INTERNAL_TOKEN"


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's destination and warns once on stderr (the
    aliases stay for one release)."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str = "", **kwargs: object) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"hybridserve: warning: {option_string} is deprecated and goes away in the next release; "
              f"use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_front_door_flags(p: argparse.ArgumentParser, host: str) -> None:
    """vLLM's dialect for the router's doors, shared by `serve` and `up`: --port is HTTP, --grpc-port gRPC."""
    p.add_argument("--host", default=host, help=f"front-door bind host (default {host})")
    p.add_argument("--port", dest="http_port", metavar="PORT", type=int, default=8000,
                   help="OpenAI-compatible HTTP port (default 8000; 0: a free one)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC front-door port (default 50051; 0: a free one)")
    p.add_argument("--no-worker-sessions", action="store_true", help="a gRPC call per request to its decode worker, "
                   "not the router's one Session stream per worker")
    p.add_argument("--no-socket-sessions", action="store_true", help="the router's sessions with decode workers over "
                   "gRPC streams, not the workers' socket sessions (length-prefixed frames on plain TCP)")
    p.add_argument("--no-warm-up-path", action="store_true", help="report ready without first sending one one-token "
                   "request through each door (the first user request then pays the path's first-time work)")
    p.add_argument("--served-model-name", dest="model_name", default=None,
                   help="model id served over the API (default: the checkpoint directory's name)")
    p.add_argument("--http-port", dest="http_port", type=int, action=DeprecatedAlias, replacement="--port",
                   help=argparse.SUPPRESS)
    p.add_argument("--model-name", dest="model_name", action=DeprecatedAlias, replacement="--served-model-name",
                   help=argparse.SUPPRESS)
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for what a request leaves unset: 'auto' (the checkpoint's "
                   "generation_config.json), 'none', or a folder with one (default auto)")
    p.add_argument("--api-key", action="append", default=None,
                   help="clients must send 'Authorization: Bearer KEY' on /v1 and as gRPC metadata; repeatable, "
                   "each KEY or NAME=KEY (the name is the client's identity for aborts, request ids and "
                   "--max-per-client) (default: $HYBRIDSERVE_API_KEY; unset: no key)")
    p.add_argument("--api-key-file", default=None,
                   help="more API keys, one KEY or NAME=KEY a line, # comments (default: none)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds an HTTP connection has for its first byte, and a request for its headers, "
                   "before it is closed (default 10)")
    p.add_argument("--max-connections", type=int, default=16384,
                   help="open HTTP connections in all; more are closed at once (default 16384)")
    p.add_argument("--max-connections-per-peer", type=int, default=4096,
                   help="open HTTP connections from one address; more are closed at once (default 4096: a load "
                   "balancer or a benchmark client brings every stream from one address)")


def add_worker_count_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-workers", type=int, default=1,
                   help="prefill workers (default 1; 0: decode workers prefill every prompt themselves)")
    p.add_argument("--decode-workers", type=int, default=1, help="decode workers (default 1; at least 1)")


def add_placement_flags(p: argparse.ArgumentParser, timeout_help: str) -> None:
    """Where the workers go and how long that may take: GPUs each, the ports they bind, the start-up deadline."""
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0,
                   help="GPUs a worker reserves on its Ray node (default 0: CPU workers; a fraction shares a GPU)")
    p.add_argument("--timeout", type=float, default=600.0, help=timeout_help)
    p.add_argument("--worker-port-base", type=int, default=0,
                   help="worker i binds gRPC, session and metrics ports BASE+3i, +3i+1, +3i+2 (default 0: free "
                   "ports the OS picks); the front doors keep --port and --grpc-port")


def add_internal_flags(p: argparse.ArgumentParser, worker_host: str | None) -> None:
    """How the router and the workers talk to each other: worker bind address and the shared internal token."""
    p.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                   help="shared secret on every internal gRPC call (router -> worker, worker -> worker) "
                   f"(default: ${INTERNAL_TOKEN_ENV}; serve generates one per run when unset)")
    add_drain_flag(p)
    add_internal_tls_options(p)
    shown = worker_host or "127.0.0.1, or node-ip with --address"
    p.add_argument("--worker-host", default=worker_host,
                   help=f"address the workers' gRPC servers bind (default {shown}; 'node-ip': the Ray node's "
                   "address; 0.0.0.0 only when asked)")


def add_internal_tls_options(p: argparse.ArgumentParser) -> None:
    from hybridserve.common.config_flags import add_config_flags
    from hybridserve.proto.internal_tls import InternalTlsConfig

    add_config_flags(p, InternalTlsConfig, "mutual TLS on internal gRPC (InternalTlsConfig)", prefix="internal-tls-")


def internal_tls(args: argparse.Namespace):  # noqa: ANN202 - InternalTlsConfig, imported lazily
    from hybridserve.common.config_flags import config_from_args
    from hybridserve.proto.internal_tls import InternalTlsConfig

    return config_from_args(InternalTlsConfig, args, prefix="internal-tls-")


def add_drain_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds the requests in flight get to finish before they are aborted (default 30)")


def _api_keys(args: argparse.Namespace) -> tuple[str, ...] | None:
    keys = args.api_key or ([os.environ["HYBRIDSERVE_API_KEY"]] if os.environ.get("HYBRIDSERVE_API_KEY") else [])
    return tuple(keys) or None


def cluster_options(args: argparse.Namespace) -> dict:
    """The fields `serve` and `up` share (deploy/options.py ClusterOptions), built from their flags."""
    from hybridserve.deploy.options import WorkerOptions
    from hybridserve.router.config import AdmissionConfig, OrchestratorConfig, RouterOptions

    model_dir, engine, tls = resolved_model_dir(args), engine_config(args), internal_tls(args)
    extra: dict[str, Any] = {}
    if hasattr(args, "max_queued"):
        extra["admission"] = AdmissionConfig(max_running=args.max_running, max_queued=args.max_queued,
                                             queue_timeout_s=getattr(args, "queue_timeout", None),
                                             max_per_client=args.max_per_client)
    local_max = getattr(args, "local_prefill_max_tokens", None)
    if local_max is not None or args.no_worker_sessions or args.no_socket_sessions:
        extra["orchestrator"] = OrchestratorConfig(local_prefill_max_tokens=local_max,
                                                   worker_sessions=not args.no_worker_sessions,
                                                   worker_socket_sessions=not args.no_socket_sessions)
    router = RouterOptions(model_dir=model_dir, model_name=args.model_name, host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, api_key=_api_keys(args), api_key_file=args.api_key_file,
                           first_byte_timeout_s=args.header_timeout, header_timeout_s=args.header_timeout,
                           max_connections=args.max_connections, max_connections_per_peer=args.max_connections_per_peer,
                           generation_config=args.generation_config,
                           internal_token=args.internal_token, drain_timeout_s=args.drain_timeout,
                           internal_tls=tls, warm_up_path=not args.no_warm_up_path, **extra)
    on_ray_cluster = getattr(args, "address", None) and not getattr(args, "no_ray", False)
    worker_host = args.worker_host or ("node-ip" if on_ray_cluster else "127.0.0.1")
    worker = WorkerOptions(model_dir=model_dir, engine=engine, host=worker_host, transfer=transfer_config(args),
                           internal_token=args.internal_token, drain_timeout_s=args.drain_timeout, internal_tls=tls)
    return dict(router=router, worker=worker, num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                num_gpus_per_worker=args.num_gpus_per_worker, timeout_s=args.timeout,
                worker_port_base=args.worker_port_base,
                prefill_engine_overrides=getattr(args, "prefill_worker_overrides", None))


# EngineConfig fields that only matter to a server (queues, standby states for transfers, cache events for a
# router): `generate` leaves them at their defaults and its --help does not list them
SERVING_ONLY_ENGINE_FIELDS = frozenset({"standby_state_slots", "max_num_waiting", "max_cache_events"})


def add_engine_options(p: argparse.ArgumentParser, offline: bool = False) -> None:
    """The EngineConfig flags; `offline` (generate): without the serving-only ones."""
    from hybridserve.common.config_flags import add_config_flags
    from hybridserve.engine.config import EngineConfig

    add_config_flags(p, EngineConfig, "engine (EngineConfig)", aliases={"enable_prefix_caching": ["--prefix-caching"]},
                     hidden=SERVING_ONLY_ENGINE_FIELDS if offline else frozenset())


def engine_config(args: argparse.Namespace):  # noqa: ANN202 - EngineConfig, imported lazily
    from hybridserve.common.config_flags import config_from_args
    from hybridserve.engine.config import EngineConfig

    return config_from_args(EngineConfig, args)


def resolved_model_dir(args: argparse.Namespace) -> str:
    from hybridserve.models.default_model import default_model_dir

    return str(args.model) if args.model else str(default_model_dir())

def add_transfer_options(p: argparse.ArgumentParser) -> None:
    from hybridserve.common.config_flags import add_config_flags
    from hybridserve.transfer.planes import TransferConfig

    add_config_flags(p, TransferConfig, "state transfer, prefill -> decode (TransferConfig)", prefix="transfer-")


def transfer_config(args: argparse.Namespace):  # noqa: ANN202 - TransferConfig, imported lazily
    from hybridserve.common.config_flags import config_from_args
    from hybridserve.transfer.planes import TransferConfig

    return config_from_args(TransferConfig, args, prefix="transfer-")

