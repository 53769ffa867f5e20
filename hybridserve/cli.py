"""The `hybridserve` command line: generate, worker, serve, up, down, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from hybridserve.cli_options import (
    INTERNAL_TOKEN_ENV,
    DeprecatedAlias,
    add_drain_flag,
    add_engine_options,
    add_front_door_flags,
    add_internal_flags,
    add_internal_tls_options,
    add_placement_flags,
    add_transfer_options,
    add_worker_count_flags,
    cluster_options,
    engine_config,
    internal_tls,
    resolved_model_dir,
    transfer_config,
)
from hybridserve.common.config_flags import add_config_flags, config_from_args, json_object


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from exc




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
    p.add_argument("--request-seed", dest="seed", type=int, action=DeprecatedAlias, replacement="--seed",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # no default: --seed's own applies
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_engine_options(p, offline=True)  # its --seed seeds the sampler
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from hybridserve.engine.llm import LLM

    given = {"top_p": args.top_p, "top_k": args.top_k, "repetition_penalty": args.repetition_penalty}
    llm = LLM(resolved_model_dir(args), generation_config=args.generation_config, **engine_config(args).__dict__)
    params = llm.generation_defaults.sampling_params(
        max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
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
    p.add_argument("--role", required=True, choices=["prefill", "decode"], help="which half of a request it serves")
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address its gRPC, session and metrics servers bind (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default 0: a free one)")
    p.add_argument("--session-port", type=int, default=0,
                   help="decode workers: port of the socket session (default 0: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (default 0: a free one)")
    add_drain_flag(p)
    add_internal_tls_options(p)
    p.add_argument("--worker-id", default=None,
                   help="the name it reports in health, logs and metrics (default: <role>-<port>)")
    p.add_argument("--worker-config", default=None,
                   help='the whole config as JSON, {"engine": {...EngineConfig}, "transfer": {...TransferConfig}} '
                   "(what serve's launcher passes; the engine and transfer flags are ignored then)")
    p.add_argument("--ready-file", default=None, help="write {address, pid} here once serving "
                   f"(the internal token, if any, is read from ${INTERNAL_TOKEN_ENV})")
    p.add_argument("--stop-on-stdin-close", action="store_true",
                   help="stop (as on SIGTERM) when standard input closes: serve's launcher holds the other end, so "
                   "the worker never outlives it")
    add_engine_options(p)
    add_transfer_options(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from hybridserve.deploy.launch import WorkerOptions, WorkerPorts, configs_from_json, serve_worker, watch_parent_pipe
    from hybridserve.deploy.preflight import check_model_dir, check_ports_free

    if args.stop_on_stdin_close:
        watch_parent_pipe()
    # the worker's own INFO lines (what fits in the state cache, where it serves) show at the default level
    logging.getLogger("hybridserve").setLevel(logging.INFO)
    model_dir = resolved_model_dir(args)
    check_model_dir(model_dir)
    ports = WorkerPorts(args.port, args.session_port, args.metrics_port)
    check_ports_free(args.host, [(ports.grpc, "--port"), (ports.session, "--session-port"),
                                 (ports.metrics, "--metrics-port")])
    if args.worker_config:  # the whole config as one JSON object, as the launcher passes it
        engine, transfer = configs_from_json(args.worker_config)
    else:
        engine, transfer = engine_config(args), transfer_config(args)
    options = WorkerOptions(model_dir=model_dir, engine=engine, host=args.host, transfer=transfer,
                            internal_token=os.environ.get(INTERNAL_TOKEN_ENV) or None,
                            drain_timeout_s=args.drain_timeout, internal_tls=internal_tls(args))
    worker_id = args.worker_id or f"{args.role}-{args.port}"
    return serve_worker(args.role, worker_id, options, ports, args.ready_file)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start prefill and decode workers and the HTTP (OpenAI) and gRPC front doors",
        description="Start a local Ray cluster (or join --address), place prefill / decode worker actors, "
        "start the front door, and print where to send requests. --no-ray starts plain processes instead.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    add_worker_count_flags(p)
    add_front_door_flags(p, "127.0.0.1")
    add_internal_flags(p, None)
    p.add_argument("--insecure-internal", action="store_true",
                   help="no internal token (any process reaching a worker port may call it; trusted hosts only)")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: start a local one)")
    p.add_argument("--no-ray", action="store_true",
                   help="start workers as plain processes (restarted with backoff when they die)")
    add_placement_flags(p, "seconds to wait for the workers to be placed and ready (default 600)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="the decode worker prefills locally when the uncached tail is this short "
                   "(default 0: only on a decode-side prefix hit)")
    p.add_argument("--log-dir", default=None,
                   help="--no-ray: write each worker's log to DIR/<worker-id>.log (default: a new temporary directory, "
                   "named in the start-up banner)")
    p.add_argument("--max-running", type=int, default=None,
                   help="requests the router runs at once (default: what the decode workers report they hold, "
                   "from their memory plan and --max-num-waiting)")
    p.add_argument("--max-queued", type=int, default=65536,
                   help="requests that may wait in the router, in arrival order, beyond the running ones; more get "
                   "429 with Retry-After (default 65536)")
    p.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request may wait in the router's queue before a 503 (default: no limit of the "
                   "router's own; the client's timeout applies)")
    p.add_argument("--max-per-client", type=int, default=0,
                   help="requests one client (API key, or address without one) may have running or queued; more "
                   "get 429 (default 0: no limit; clients behind one proxy share an address)")
    p.add_argument("--gpus", default=None,
                   help="worker -> GPU placement for --no-ray: 'prefill=0,decode=1', 'prefill-0=0,decode-0=1' or "
                   "'0,1' in start order (default: round-robin over the host's GPUs)")
    p.add_argument("--prefill-worker-overrides", type=json_object, default=None,
                   help="JSON of engine options that differ for prefill workers, e.g. '{\"prefill_chunk_size\": 4096}' "
                   "(they run no decodes: big prefill steps cost no inter-token latency)")
    from hybridserve.deploy.ray_head import RayHeadOptions

    add_config_flags(p, RayHeadOptions, "the local Ray head (serve without --address or --no-ray)", prefix="ray-")
    add_engine_options(p)
    add_transfer_options(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from hybridserve.deploy.serve import ServeOptions, serve

    if args.insecure_internal and args.internal_token:
        raise ValueError("--insecure-internal and --internal-token exclude each other")
    from hybridserve.deploy.ray_head import RayHeadOptions

    options = ServeOptions(**cluster_options(args), ray_address=args.address, use_ray=not args.no_ray,
                           ray_head=config_from_args(RayHeadOptions, args, prefix="ray-"),
                           gpus=args.gpus, log_dir=args.log_dir, secure_internal=not args.insecure_internal)
    return serve(options)



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
    add_worker_count_flags(p)
    add_front_door_flags(p, "0.0.0.0")
    add_internal_flags(p, "node-ip")
    add_placement_flags(p, "seconds to wait for the cluster, the workers' placement and their health (default 600)")
    add_engine_options(p)
    add_transfer_options(p)
    p.set_defaults(func=_run_up)
    d = sub.add_parser("down", help="remove everything `hybridserve up` deployed on a Ray cluster")
    d.add_argument("--address", required=True, help="Ray cluster address")
    d.set_defaults(func=_run_down)


def _run_up(args: argparse.Namespace) -> int:
    from hybridserve.deploy.cluster_up import UpOptions, up

    options = UpOptions(**cluster_options(args), address=args.address)
    lines = up(options)
    print(f"hybridserve: {args.prefill_workers} prefill and {args.decode_workers} decode workers ready", flush=True)
    for line in lines:
        print(f"hybridserve: {line}", flush=True)
    http = next((line.split()[2] for line in lines if line.startswith("OpenAI API")), None)
    if http:  # the last line: where most clients send requests
        print(f"hybridserve: send requests to the OpenAI API at {http}", flush=True)
    return 0


def _run_down(args: argparse.Namespace) -> int:
    from hybridserve.deploy.cluster_up import down

    removed = down(args.address)
    print(f"hybridserve: removed {len(removed)} actors: {', '.join(removed) or 'none'}", flush=True)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark of the source checkout's bench/ folder (serve: bench/serving/serve.py)",
        description="Run a benchmark script of the source checkout: `hybridserve bench serve ARGS` is "
        "`python bench/serving/serve.py ARGS` (`hybridserve bench serve --help` lists them).",
    )
    p.add_argument("name", choices=["serve"], help="serve: replay a workload against a running server")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "serving" / f"{args.name}.py"
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


def _early_preflight(argv: list[str]) -> None:
    """The checks that need no flag but --model and the ports, before the full parser is built (building it
    imports torch, seconds on a small machine): a wrong path or a taken port fails at once."""
    from hybridserve.deploy.preflight import check_model_dir, check_ports_free, check_ray_reachable

    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command not in ("serve", "up", "worker"):
        return
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="0.0.0.0" if command == "up" else "127.0.0.1")
    p.add_argument("--port", "--http-port", dest="port", type=int, default=8000 if command == "serve" else 0)
    p.add_argument("--grpc-port", type=int, default=50051 if command == "serve" else 0)
    p.add_argument("--address", default=None)
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    try:
        known, _ = p.parse_known_args(argv[argv.index(command) + 1:])
    except SystemExit:  # malformed: the full parser says what is wrong
        return
    if known.help:
        return
    if known.model:
        check_model_dir(known.model)
    if command == "serve":
        check_ports_free(known.host, [(known.port, "--port"), (known.grpc_port, "--grpc-port")])
    elif command == "worker":
        check_ports_free(known.host, [(known.port, "--port")])
    if known.address and not known.no_ray:
        check_ray_reachable(known.address)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _early_preflight(argv)
    except ValueError as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hybridserve.deploy.launch import WorkerStartError

    try:
        return int(args.func(args))
    except (ValueError, TimeoutError) as exc:  # bad input, a failed pre-flight check, a deadline: one line
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2
    except WorkerStartError as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C (or SIGTERM) before serving: what had started is stopped
        print(f"hybridserve: interrupted ({exc.args[0] if exc.args else 'SIGINT'}): stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
