"""Serving throughput at production concurrency: one server, a sweep of requests kept in flight.

Starts `hybridserve serve --no-ray --prefill-workers 0 --decode-workers 1 --load-format dummy` on a config.json
(random weights of the real shapes), then for each concurrency N sends --num-prompts random prompts of
--input-len tokens asking for --output-len tokens (ignore_eos) through an OpenAI streaming client that keeps N
in flight, and reports output tok/s, TPOT / ITL / TTFT p50 and p99, the refused (failed) requests, and beside
each TPOT the decode step's bytes floor at that batch (bench/serving/step_floor.py, at the copy bandwidth
measured on the GPU before the server starts, or --copy-gbps).

    python bench/serving/throughput.py --config bench/configs/nemotron-nano-9b-v2.json --concurrency 64,256 \\
        --out results/9b -- --max-num-seqs 256

Everything after `--` goes to `hybridserve serve`. Writes OUT/<label>-c<N>.json per point (config, metrics,
floor, per-request records) and appends a row per point to OUT/table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # step_floor beside this file; serve_* in bench/

from serve_client import ClientConfig, metrics_urls, run_with_metrics, server_info  # noqa: E402
from serve_metrics import summarize  # noqa: E402
from serve_workloads import WorkloadConfig, build_workload  # noqa: E402
from step_floor import describe, floor_ms, model_bytes, step_bytes, with_fp8_quantization  # noqa: E402

logger = logging.getLogger("throughput")

VLLM_RECIPE = {"output_tok_s": 15828, "tpot_p50_ms": 61, "what": "vLLM recipe, Nemotron-3-Nano-30B-A3B-FP8, one H200, "
               "1024/1024 tokens, 2048 prompts at 1024 in flight, FP8 KV cache"}
TABLE_HEADER = ("| label | in flight | prompts | output tok/s | TPOT p50 / p99 ms | floor ms (batch) | ITL p50 / p99 ms "
                "| TTFT p50 / p99 ms | refused |\n|---|---|---|---|---|---|---|---|---|\n")


def concurrencies(text: str) -> list[int]:
    """'64,256,1k' -> [64, 256, 1024]."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"concurrency must be > 0, got {part!r}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("no concurrency given")
    return out


def flag_value(argv: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`), else `default`."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def state_dtypes(config_json: dict[str, Any], server_args: list[str]) -> tuple[str, str]:
    """(SSM state dtype, KV dtype) the server runs with: its flags, else the checkpoint's, else fp32 / bf16."""
    ssm = flag_value(server_args, "--mamba-ssm-cache-dtype", "auto")
    if ssm == "auto":
        ssm = str(config_json.get("mamba_ssm_cache_dtype", "float32"))
    kv = flag_value(server_args, "--kv-cache-dtype", "auto")
    return ssm, "bfloat16" if kv == "auto" else kv


def point_floor(mb: Any, batch: int, context: int, ssm: str, kv: str, copy_gbps: float) -> dict[str, Any]:
    """The decode step's bytes floor at `batch` sequences of `context` tokens: ms and bytes by part."""
    parts = step_bytes(mb, batch, context, ssm_dtype=ssm, kv_dtype=kv)
    return {"batch": batch, "context": context, "ms": floor_ms(parts["total"], copy_gbps),
            "GB": {k: v / 1e9 for k, v in parts.items()}}


def table_row(label: str, result: dict[str, Any]) -> str:
    """One markdown row of a sweep point."""
    m, f = result["metrics"], result["floor"]

    def pair(key: str) -> str:
        d = m[key]
        return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"

    return (f"| {label} | {result['concurrency']} | {result['num_prompts']} | {m['output_throughput']:,.0f} | "
            f"{pair('tpot_ms')} | {f['ms']:.1f} ({f['batch']}) | {pair('itl_ms')} | {pair('ttft_ms')} | "
            f"{m['failed']} / {result['num_prompts']} |")


def measure_copy_gbps() -> float | None:
    """Device-to-device copy bandwidth (GB/s, read + write) of 1 GiB buffers, median of 20; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = 1 << 28
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    ms = sorted(times[3:])[len(times[3:]) // 2]
    return 2 * n * 4 / ms / 1e6


def port_in_use(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:`port` (it, not our server, would answer /ready)."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """`hybridserve serve` as a child process in its own process group (its workers are its children)."""

    def __init__(self, model_dir: Path, port: int, server_args: list[str], log_path: Path, device: str = "cuda",
                 dtype: str = "bfloat16", pythonpath: Path | None = None) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "hybridserve", "serve", "--no-ray", "--model", str(model_dir),
               "--prefill-workers", "0", "--decode-workers", "1", "--load-format", "dummy", "--device", device,
               "--dtype", dtype, "--port", str(port), "--grpc-port", "0", *server_args]
        if port_in_use(port):
            raise RuntimeError(f"port {port} is taken (an earlier server still running?): its /ready would answer "
                               "for this one; stop it or pass --port")
        logger.info("starting: %s", " ".join(cmd))
        self.log = log_path.open("w")
        env = None
        if pythonpath is not None:  # another tree's server under the same client (before / after comparisons)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath),
                                                                             os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                     cwd=pythonpath)  # not the repository root, whose hybridserve/ would win

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2):
                    return True
            except OSError:
                time.sleep(1.0)
        return False

    def stop(self) -> None:
        """SIGTERM to the server's process group (this process started it), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def run_point(base_url: str, model: str, concurrency: int, num_prompts: int, args: argparse.Namespace,
              index: int, vocab: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One sweep point: (summary metrics, per-request records); fresh prompt ids per point (no cache hits)."""
    wcfg = WorkloadConfig(kind="random", num_prompts=num_prompts, input_len=args.input_len,
                          output_len=args.output_len, token_range=(3, min(30000, vocab)), seed=args.seed, id_seed=index + 1)
    sessions = build_workload(wcfg)
    ccfg = ClientConfig(base_url=base_url, model=model, ignore_eos=True, timeout_s=args.request_timeout,
                        max_concurrency=concurrency, transport=args.client_transport)
    urls = asyncio.run(metrics_urls(base_url, []))
    records, duration, delta = asyncio.run(run_with_metrics(ccfg, sessions, [0.0] * len(sessions), urls))
    # per-request records without their inter-token gaps (1,024 per request: summarized in the metrics)
    return summarize(records, duration, delta), [{k: v for k, v in r.to_dict().items() if k != "itl"}
                                                 for r in records]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/serving/throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the model's config.json (dummy weights)")
    p.add_argument("--fp8", action="store_true", help="add an FP8 quantization_config to the config (fp8 weights)")
    p.add_argument("--label", default=None, help="row label (default: the config's file stem, +fp8)")
    p.add_argument("--concurrency", type=concurrencies, default=[64, 256, 512, 1024],
                   help="requests kept in flight, comma-separated (default 64,256,512,1024)")
    p.add_argument("--waves", type=int, default=2,
                   help="prompts per point as a multiple of its concurrency (2: 2,048 prompts at 1,024 in flight)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds a client waits per request")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server's /ready")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from start after which no new point begins (the rest are listed as skipped)")
    p.add_argument("--copy-gbps", type=float, default=None, help="copy bandwidth for the floor (default: measured)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--client-transport", choices=("raw", "httpx"), default="raw",
                   help="the client's HTTP streaming (raw asyncio: keeps up at 16k tokens/s; httpx: the earlier runs')")
    p.add_argument("--device", default="cuda", help="the worker's device (cpu: a smoke test of the harness)")
    p.add_argument("--dtype", default="bfloat16", help="weights and activations")
    p.add_argument("--server-pythonpath", type=Path, default=None,
                   help="put this folder first on the server's PYTHONPATH (run another tree's server, e.g. one "
                   "installed with pip --target, under the same client)")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for the JSON results, table.md and the workers' logs (LABEL-logs/, unless --log-dir is given)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    t0 = time.monotonic()
    config_json = json.loads(args.config.read_text())
    if args.fp8:
        config_json = with_fp8_quantization(config_json)
    label = args.label or args.config.stem + ("-fp8" if args.fp8 else "")
    mb = model_bytes(config_json)
    ssm, kv = state_dtypes(config_json, server_args)
    copy_gbps = args.copy_gbps or measure_copy_gbps()
    if copy_gbps is None:
        raise SystemExit("no CUDA device to measure the copy bandwidth on: pass --copy-gbps")
    max_seqs = int(flag_value(server_args, "--max-num-seqs", "32") or 32)
    args.out.mkdir(parents=True, exist_ok=True)
    if flag_value(server_args, "--log-dir", None) is None:  # the workers' logs (memory plan, loop lines) come back
        server_args = [*server_args, "--log-dir", str((args.out / f"{label}-logs").resolve())]
    table = args.out / "table.md"
    if not table.exists():
        table.write_text(TABLE_HEADER)
    # a SIGTERM (timeout, the sweep script's trap) unwinds through `finally`, so the server goes down with us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config_json))
        server = Server(Path(model_dir), args.port, server_args, args.out / f"{label}.server.log",
                        args.device, args.dtype, args.server_pythonpath)
        try:
            if not server.wait_ready(args.ready_timeout) or server.proc.poll() is not None:
                logger.error("the server did not come up: see %s", args.out / f"{label}.server.log")
                return 2
            logger.info("ready after %.0f s", time.monotonic() - t0)
            base_url = f"http://127.0.0.1:{args.port}"
            model = asyncio.run(server_info(base_url))["model"]
            for index, n in enumerate(args.concurrency):
                num_prompts = args.waves * n
                if args.time_budget is not None and time.monotonic() - t0 > args.time_budget:
                    logger.warning("skipped %s at %d in flight: past --time-budget", label, n)
                    with table.open("a") as f:
                        f.write(f"| {label} | {n} | {num_prompts} | skipped (time budget) |||||| |\n")
                    continue
                metrics, records = run_point(base_url, model, n, num_prompts, args, index, mb.vocab)
                batch = min(n, max_seqs)
                rows = metrics.get("engine_decode_rows_mean")
                floor = point_floor(mb, int(round(rows)) if rows else batch, args.input_len + args.output_len // 2,
                                    ssm, kv, copy_gbps)
                result = {"label": label, "concurrency": n, "num_prompts": num_prompts, "input_len": args.input_len,
                          "output_len": args.output_len, "server_args": server_args, "ssm_dtype": ssm,
                          "kv_dtype": kv, "copy_GBps": copy_gbps, "model_bytes": describe(mb), "floor": floor,
                          "vllm_recipe": VLLM_RECIPE, "metrics": metrics, "requests": records}
                (args.out / f"{label}-c{n}.json").write_text(json.dumps(result, indent=1) + "\n")
                row = table_row(label, result)
                with table.open("a") as f:
                    f.write(row + "\n")
                print(row, flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
