"""The `hybridserve` command line: generate, worker, serve, up, down, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from hybridserve.config_flags import json_object

INTERNAL_TOKEN_ENV = "HYBRIDSERVE_INTERNAL_TOKEN"


class _DeprecatedAlias(argparse.Action):
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


def _add_front_door_flags(p: argparse.ArgumentParser, host: str) -> None:
    """vLLM's dialect for the router's doors, shared by `serve` and `up`: --port is HTTP, --grpc-port gRPC."""
    p.add_argument("--host", default=host, help=f"front-door bind host (default {host})")
    p.add_argument("--port", dest="http_port", metavar="PORT", type=int, default=8000,
                   help="OpenAI-compatible HTTP port (default 8000; 0: a free one)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC front-door port (default 50051; 0: a free one)")
    p.add_argument("--no-worker-sessions", action="store_true", help="a gRPC call per request to its decode worker, "
                   "not the router's one Session stream per worker")
    p.add_argument("--served-model-name", dest="model_name", default=None,
                   help="model id served over the API (default: the checkpoint directory's name)")
    p.add_argument("--http-port", dest="http_port", type=int, action=_DeprecatedAlias, replacement="--port",
                   help=argparse.SUPPRESS)
    p.add_argument("--model-name", dest="model_name", action=_DeprecatedAlias, replacement="--served-model-name",
                   help=argparse.SUPPRESS)
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for what a request leaves unset: 'auto' (the checkpoint's "
                   "generation_config.json), 'none', or a folder with one (default auto)")
    p.add_argument("--api-key", default=os.environ.get("HYBRIDSERVE_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' on /v1 and as gRPC metadata "
                   "(default: $HYBRIDSERVE_API_KEY; unset: no key)")


def _add_internal_flags(p: argparse.ArgumentParser, worker_host: str | None) -> None:
    """How the router and the workers talk to each other: worker bind address and the shared internal token."""
    p.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                   help="shared secret on every internal gRPC call (router -> worker, worker -> worker) "
                   f"(default: ${INTERNAL_TOKEN_ENV}; serve generates one per run when unset)")
    _add_drain_flag(p)
    _add_internal_tls_options(p)
    shown = worker_host or "127.0.0.1, or node-ip with --address"
    p.add_argument("--worker-host", default=worker_host,
                   help=f"address the workers' gRPC servers bind (default {shown}; 'node-ip': the Ray node's "
                   "address; 0.0.0.0 only when asked)")


def _add_internal_tls_options(p: argparse.ArgumentParser) -> None:
    from hybridserve.config_flags import add_config_flags
    from hybridserve.proto.internal_tls import InternalTlsConfig

    add_config_flags(p, InternalTlsConfig, "mutual TLS on internal gRPC (InternalTlsConfig)", prefix="internal-tls-")


def _internal_tls(args: argparse.Namespace):  # noqa: ANN202 - InternalTlsConfig, imported lazily
    from hybridserve.config_flags import config_from_args
    from hybridserve.proto.internal_tls import InternalTlsConfig

    return config_from_args(InternalTlsConfig, args, prefix="internal-tls-")


def _add_drain_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds the requests in flight get to finish before they are aborted (default 30)")


def _cluster_options(args: argparse.Namespace) -> dict:
    """The fields `serve` and `up` share (deploy/options.py ClusterOptions), built from their flags."""
    from hybridserve.deploy.options import WorkerOptions
    from hybridserve.router.config import AdmissionConfig, OrchestratorConfig, RouterOptions

    model_dir, engine, tls = _model_dir(args), _engine_config(args), _internal_tls(args)
    extra: dict[str, Any] = {}
    if getattr(args, "max_running", None) is not None:
        extra["admission"] = AdmissionConfig(max_running=args.max_running, max_queued=args.max_queued,
                                             max_per_client=args.max_per_client)
    local_max = getattr(args, "local_prefill_max_tokens", None)
    if local_max is not None or args.no_worker_sessions:
        extra["orchestrator"] = OrchestratorConfig(local_prefill_max_tokens=local_max,
                                                   worker_sessions=not args.no_worker_sessions)
    router = RouterOptions(model_dir=model_dir, model_name=args.model_name, host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, api_key=args.api_key, generation_config=args.generation_config,
                           internal_token=args.internal_token, drain_timeout_s=args.drain_timeout,
                           internal_tls=tls, **extra)
    on_ray_cluster = getattr(args, "address", None) and not getattr(args, "no_ray", False)
    worker_host = args.worker_host or ("node-ip" if on_ray_cluster else "127.0.0.1")
    worker = WorkerOptions(model_dir=model_dir, engine=engine, host=worker_host, transfer=_transfer_config(args),
                           internal_token=args.internal_token, drain_timeout_s=args.drain_timeout, internal_tls=tls)
    return dict(router=router, worker=worker, num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                num_gpus_per_worker=args.num_gpus_per_worker,
                prefill_engine_overrides=getattr(args, "prefill_worker_overrides", None))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from exc


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    from hybridserve.config_flags import add_config_flags
    from hybridserve.engine.config import EngineConfig

    add_config_flags(p, EngineConfig, "engine (EngineConfig)", aliases={"enable_prefix_caching": ["--prefix-caching"]})


def _engine_config(args: argparse.Namespace):  # noqa: ANN202 - EngineConfig, imported lazily
    from hybridserve.config_flags import config_from_args
    from hybridserve.engine.config import EngineConfig

    return config_from_args(EngineConfig, args)


def _model_dir(args: argparse.Namespace) -> str:
    from hybridserve.models.default_model import default_model_dir

    return str(args.model) if args.model else str(default_model_dir())


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt with the offline engine",
        description="Load a checkpoint (default: the embedded tiny NemotronH) and generate for one prompt.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory in transformers layout (default: embedded)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint)")
    group.add_argument("--prompt-ids", type=_parse_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config, else 1")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config, else -1 (off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the model's generation_config, else 1 (off)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: 'auto' (the checkpoint's generation_config.json), 'none', or a folder "
                   "(default auto)")
    p.add_argument("--request-seed", type=int, default=None, help="seed of this request's sampler")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _add_engine_options(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from hybridserve.engine.llm import LLM

    given = {"top_p": args.top_p, "top_k": args.top_k, "repetition_penalty": args.repetition_penalty}
    llm = LLM(_model_dir(args), generation_config=args.generation_config, **_engine_config(args).__dict__)
    params = llm.generation_defaults.sampling_params(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.request_seed, ignore_eos=args.ignore_eos,
        **{name: value for name, value in given.items() if value is not None})
    if args.prompt is not None:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.generate(sampling_params=params, prompt_token_ids=[args.prompt_ids])[0]
    if args.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens,
            "num_draft_tokens": out.num_draft_tokens, "num_accepted_tokens": out.num_accepted_tokens,
        }))
    else:
        if out.text is not None:
            print(out.text)
        spec = f", accepted {out.num_accepted_tokens}/{out.num_draft_tokens} drafts" if out.num_draft_tokens else ""
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}{spec}] ids: {out.token_ids}")
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run one prefill or decode worker (a gRPC server) in this process",
        description="Run one worker as a plain process; `serve` and the process launcher start these.",
    )
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    _add_drain_flag(p)
    _add_internal_tls_options(p)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--worker-config", default=None,
                   help='the whole config as JSON, {"engine": {...EngineConfig}, "transfer": {...TransferConfig}} '
                   "(what serve's launcher passes; the engine and transfer flags are ignored then)")
    p.add_argument("--ready-file", default=None, help="write {address, pid} here once serving "
                   f"(the internal token, if any, is read from ${INTERNAL_TOKEN_ENV})")
    _add_engine_options(p)
    _add_transfer_options(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from hybridserve.deploy.launch import WorkerOptions, configs_from_json, serve_worker

    if args.worker_config:  # the whole config as one JSON object, as the launcher passes it
        engine, transfer = configs_from_json(args.worker_config)
    else:
        engine, transfer = _engine_config(args), _transfer_config(args)
    options = WorkerOptions(model_dir=_model_dir(args), engine=engine, host=args.host, transfer=transfer,
                            internal_token=os.environ.get(INTERNAL_TOKEN_ENV) or None,
                            drain_timeout_s=args.drain_timeout, internal_tls=_internal_tls(args))
    worker_id = args.worker_id or f"{args.role}-{args.port}"
    return serve_worker(args.role, worker_id, options, args.port, args.ready_file)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start prefill and decode workers and the HTTP (OpenAI) and gRPC front doors",
        description="Start a local Ray cluster (or join --address), place prefill / decode worker actors, "
        "start the front door, and print where to send requests. --no-ray starts plain processes instead.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    _add_front_door_flags(p, "127.0.0.1")
    _add_internal_flags(p, None)
    p.add_argument("--insecure-internal", action="store_true",
                   help="no internal token (any process reaching a worker port may call it; trusted hosts only)")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: start a local one)")
    p.add_argument("--no-ray", action="store_true", help="start workers as plain processes")
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0)
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="the decode worker prefills locally when the uncached tail is this short "
                   "(default 0: only on a decode-side prefix hit)")
    p.add_argument("--log-dir", default=None,
                   help="--no-ray: write each worker's log to DIR/<worker-id>.log (default: a new temporary directory, "
                   "named in the start-up banner)")
    p.add_argument("--max-running", type=int, default=256, help="requests the router runs at once")
    p.add_argument("--max-queued", type=int, default=512, help="requests that may wait; more get 429")
    p.add_argument("--max-per-client", type=int, default=0,
                   help="requests one client (API key, or address without one) may have running or queued; more "
                   "get 429 (default 0: no limit; clients behind one proxy share an address)")
    p.add_argument("--gpus", default=None,
                   help="worker -> GPU placement for --no-ray: 'prefill=0,decode=1', 'prefill-0=0,decode-0=1' or "
                   "'0,1' in start order (default: round-robin over the host's GPUs)")
    p.add_argument("--prefill-worker-overrides", type=json_object, default=None,
                   help="JSON of engine options that differ for prefill workers, e.g. '{\"prefill_chunk_size\": 4096}' "
                   "(they run no decodes: big prefill steps cost no inter-token latency)")
    _add_engine_options(p)
    _add_transfer_options(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from hybridserve.deploy.serve import ServeOptions, serve

    if args.insecure_internal and args.internal_token:
        raise ValueError("--insecure-internal and --internal-token exclude each other")
    options = ServeOptions(**_cluster_options(args), ray_address=args.address, use_ray=not args.no_ray,
                           gpus=args.gpus, log_dir=args.log_dir, secure_internal=not args.insecure_internal)
    return serve(options)


def _add_transfer_options(p: argparse.ArgumentParser) -> None:
    from hybridserve.config_flags import add_config_flags
    from hybridserve.transfer.planes import TransferConfig

    add_config_flags(p, TransferConfig, "state transfer, prefill -> decode (TransferConfig)", prefix="transfer-")


def _transfer_config(args: argparse.Namespace):  # noqa: ANN202 - TransferConfig, imported lazily
    from hybridserve.config_flags import config_from_args
    from hybridserve.transfer.planes import TransferConfig

    return config_from_args(TransferConfig, args, prefix="transfer-")


def _add_up_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="deploy workers and the router as detached actors on a running Ray cluster, then return",
        description="Place prefill / decode worker actors on nodes offering the `prefill` / `decode` custom "
        "resources and the router on the head node, wait until all are healthy, print the endpoints. "
        "Re-running is idempotent; changing the worker counts scales the deployment.",
    )
    p.add_argument("--address", required=True, help="Ray cluster address, e.g. 10.0.0.1:6379 or auto")
    p.add_argument("--model", default=None, help="checkpoint directory, the same path on every node (default: embedded)")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    _add_front_door_flags(p, "0.0.0.0")
    _add_internal_flags(p, "node-ip")
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for healthy workers")
    _add_engine_options(p)
    _add_transfer_options(p)
    p.set_defaults(func=_run_up)
    d = sub.add_parser("down", help="remove everything `hybridserve up` deployed on a Ray cluster")
    d.add_argument("--address", required=True, help="Ray cluster address")
    d.set_defaults(func=_run_down)


def _run_up(args: argparse.Namespace) -> int:
    from hybridserve.deploy.cluster_up import UpOptions, up

    options = UpOptions(**_cluster_options(args), address=args.address, timeout_s=args.timeout)
    lines = up(options)
    print(f"hybridserve: {args.prefill_workers} prefill and {args.decode_workers} decode workers ready", flush=True)
    for line in lines:
        print(f"hybridserve: {line}", flush=True)
    return 0


def _run_down(args: argparse.Namespace) -> int:
    from hybridserve.deploy.cluster_up import down

    removed = down(args.address)
    print(f"hybridserve: removed {len(removed)} actors: {', '.join(removed) or 'none'}", flush=True)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark of the source checkout's bench/ folder (serve: bench/serve.py)",
        description="Run a benchmark script of the source checkout: `hybridserve bench serve ARGS` is "
        "`python bench/serve.py ARGS` (`hybridserve bench serve --help` lists them).",
    )
    p.add_argument("name", choices=["serve"], help="serve: replay a workload against a running server")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / f"{args.name}.py"
    if not script.is_file():
        raise ValueError(f"{script} is missing: `hybridserve bench` runs from a source checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location(f"hybridserve_bench_{args.name}", script)
    if spec is None or spec.loader is None:
        raise ValueError(f"{script} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(args.args))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridserve",
        description="Serve hybrid Mamba2 + attention models (NemotronH, Mamba2): offline generation, "
        "disaggregated prefill / decode workers, the front door.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _add_worker(sub)
    _add_serve(sub)
    _add_up_down(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except (ValueError, TimeoutError) as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
