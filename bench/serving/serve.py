"""Serving benchmark: replay a workload against a RUNNING server over HTTP and report latency and throughput.

Start a server (`hybridserve serve ...`, default http://127.0.0.1:8000), then:

    python bench/serving/serve.py --workload random --num-prompts 200 --input-len 512 --output-len 128 \
        --range-ratio 0.5 --request-rate 4 --result-dir out/
    python bench/serving/serve.py --workload shared-prefix --num-groups 4 --prefix-len 2048 --input-len 64 \
        --num-prompts 64 --request-rate 1,2,4,inf --max-concurrency 32 --result-dir out/
    python bench/serving/serve.py --workload multi-turn --num-conversations 16 --num-turns 4 --input-len 64 \
        --output-len 64 --request-rate 2 --result-dir out/
    python bench/serving/serve.py --compare off.json on.json --labels "MTP off,MTP on" --result-dir out/

(`hybridserve bench serve ARGS` runs the same from a source checkout.) Requests are streamed OpenAI
`/v1/completions` with token-id prompts (random ids in --token-range), `ignore_eos` so outputs have the asked
length, and `stream_options.include_usage`. Sessions (one request, or one conversation whose turns run in
order, each sending the whole history plus the previous answer plus a new user message) start at Poisson
(or --arrival fixed) offsets at --request-rate per second (inf: all at once), at most --max-concurrency
requests in flight.

Each rate writes `<name>-rate<R>.json` (config, metrics, per-request records) and `<name>-rate<R>-cdf.png`
(TTFT / ITL / e2e CDFs); several rates also write `<name>-sweep.json` and `<name>-sweep.png`. Metrics: request
and token throughput, TTFT / TPOT / ITL / e2e (mean, p50, p90, p99, max; ms; TPOT and ITL as in vLLM's
benchmark_serving), failures by reason, the prefix-hit ratio (usage `cached_tokens`, else the workers'
Prometheus hit-token counter) and the speculative-decoding acceptance length (1 + accepted / verify steps
from the workers' Prometheus counters; null without them), scraped through the router's `/targets`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_client import ClientConfig, metrics_urls, run_sessions, run_with_metrics, server_info  # noqa: E402
from serve_metrics import summarize  # noqa: E402
from serve_workloads import ARRIVALS, WORKLOADS, WorkloadConfig, arrival_offsets, build_workload  # noqa: E402

RESULT_VERSION = 1


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive numbers or inf, got {text!r}") from exc
    if not rates or any(not r > 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def _int_at_least(minimum: int):  # noqa: ANN202 - an argparse type
    """An argparse type: an integer >= minimum, with an error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from exc
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"takes LO,HI (token ids in [LO, HI)), got {text!r}") from exc
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"needs 0 <= LO < HI, got {text!r}")
    return lo, hi


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/serving/serve.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's HTTP address")
    s.add_argument("--model", default=None, help="model id to send (default: the server's, from /v1/models)")
    s.add_argument("--endpoint", default="/v1/completions")
    s.add_argument("--metrics-url", action="append", default=[],
                   help="extra Prometheus /metrics URL to scrape (repeatable; the router's /targets are always used)")
    s.add_argument("--no-scrape", action="store_true", help="do not scrape Prometheus metrics")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-prompts", "--num-conversations", dest="num_prompts", type=_positive_int, default=100,
                   help="requests (random, shared-prefix) or conversations (multi-turn)")
    w.add_argument("--input-len", type=_positive_int, default=256,
                   help="prompt tokens (random), suffix tokens (shared-prefix), user-message tokens (multi-turn)")
    w.add_argument("--output-len", type=_positive_int, default=64, help="output tokens per request")
    w.add_argument("--range-ratio", type=_ratio, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    w.add_argument("--num-groups", type=_positive_int, default=4, help="shared-prefix: groups sharing a prefix")
    w.add_argument("--prefix-len", type=_nonneg_int, default=None,
                   help="shared-prefix: shared prefix tokens (default 1024); multi-turn: system prompt (default 0)")
    w.add_argument("--num-turns", type=_positive_int, default=3, help="multi-turn: turns per conversation")
    w.add_argument("--token-range", type=_token_range, default=(3, 256),
                   help="random prompt token ids in [LO, HI): keep inside the served vocabulary")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="sessions per second; comma-separated for a sweep, e.g. 1,2,4,inf (inf: all at once)")
    a.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    a.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most")
    a.add_argument("--warmup", type=_nonneg_int, default=0,
                   help="send this many sessions of the workload (fresh token ids) at once before measuring, so "
                        "kernel compilation and first-use costs stay out of the results")
    a.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    a.add_argument("--id-seed", type=int, default=None,
                   help="token-id seed (default: the run's index in the sweep): two runs with one --seed and "
                        "different --id-seed have the same lengths and arrivals but prompts no cache shares")
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (outputs may be shorter than --output-len)")
    r.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o = p.add_argument_group("output")
    o.add_argument("--result-dir", type=Path, default=Path("."))
    o.add_argument("--result-name", default=None, help="file name stem (default: <workload>-<UTC time>)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--compare", nargs="+", type=Path, default=None, metavar="RESULT_JSON",
                   help="plot these result (or sweep) files side by side instead of running")
    o.add_argument("--labels", default=None, help="comma-separated labels of --compare files (default: file names)")
    return p


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(kind=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.range_ratio, num_groups=args.num_groups,
                          prefix_len=args.prefix_len, num_turns=args.num_turns, token_range=args.token_range,
                          seed=args.seed)


def _rate_tag(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _client_config(args: argparse.Namespace, info: dict, wcfg: WorkloadConfig) -> ClientConfig:
    return ClientConfig(base_url=args.base_url, model=info["model"], endpoint=args.endpoint,
                        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
                        timeout_s=args.timeout, max_concurrency=args.max_concurrency, token_range=wcfg.token_range,
                        seed=args.seed)


async def run_warmup(args: argparse.Namespace, wcfg: WorkloadConfig, info: dict) -> tuple[int, int]:
    """`--warmup` sessions at once with token ids no measured run uses; returns (completed, failed)."""
    warm = replace(wcfg, id_seed=1_000_000, num_prompts=args.warmup)
    sessions = build_workload(warm)
    records, _ = await run_sessions(_client_config(args, info, warm), sessions, [0.0] * len(sessions))
    done = sum(r.success for r in records)
    return done, len(records) - done


async def run_one(args: argparse.Namespace, wcfg: WorkloadConfig, info: dict, rate: float, index: int = 0) -> dict:
    """Run `index` of a sweep, at `rate`: the result dict (config, metrics, counter deltas, per-request records).

    Each run of a sweep draws fresh token ids (same lengths), so no run finds an earlier one's prompts cached."""
    wcfg = replace(wcfg, id_seed=index if args.id_seed is None else args.id_seed + index)
    sessions = build_workload(wcfg)
    offsets = arrival_offsets(len(sessions), rate, args.arrival, args.seed)
    ccfg = _client_config(args, info, wcfg)
    urls = None if args.no_scrape else await metrics_urls(args.base_url, args.metrics_url)
    records, duration, delta = await run_with_metrics(ccfg, sessions, offsets, urls)
    config = {"base_url": args.base_url, "model": info["model"], "max_model_len": info["max_model_len"],
              "endpoint": args.endpoint, "workload": wcfg.kind, "workload_config": asdict(wcfg),
              "request_rate": "inf" if math.isinf(rate) else rate, "arrival": args.arrival,
              "max_concurrency": args.max_concurrency, "temperature": args.temperature,
              "ignore_eos": args.ignore_eos, "extra_body": args.extra_body, "metrics_urls": urls}
    return {"version": RESULT_VERSION, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.node(), "config": config, "metrics": summarize(records, duration, delta),
            "counters_delta": delta, "requests": [r.to_dict() for r in records]}


def _write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def format_summary(result: dict) -> str:
    """A short table of a run's metrics."""
    m, c = result["metrics"], result["config"]
    lines = [f"== {c['workload']} @ {c['request_rate']} req/s ({c['arrival']}) ==",
             f"completed / failed       {m['completed']} / {m['failed']}  {m['failure_reasons'] or ''}",
             f"duration                 {m['duration_s']:.2f} s",
             f"request throughput       {m['request_throughput']:.3f} req/s",
             f"output / total tokens/s  {m['output_throughput']:.1f} / {m['total_token_throughput']:.1f}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = m[key]
        vals = "  ".join(f"{q} {d[q]:.1f}" if d[q] is not None else f"{q} -" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key[:-3].upper():<8} (ms)            {vals}")
    hit = m["prefix_hit_ratio"]
    lines.append(f"prefix hit ratio         {'-' if hit is None else f'{hit:.3f}'} ({m['prefix_hit_source'] or 'n/a'})")
    acc = m["spec_acceptance_length"]
    lines.append(f"spec acceptance length   {'-' if acc is None else f'{acc:.3f}'}")
    return "\n".join(lines)


def run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from serve_plots import plot_compare

    results = []
    for path in args.compare:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"--compare: cannot read {path}: {exc}")
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.compare]
    if len(labels) != len(results):
        parser.error(f"--labels has {len(labels)} labels for {len(results)} --compare files")
    args.result_dir.mkdir(parents=True, exist_ok=True)
    out = args.result_dir / f"{args.result_name or 'compare'}.png"
    try:
        plot_compare(results, labels, out)
    except (KeyError, ValueError) as exc:
        parser.error(f"--compare: {exc!r} (are these bench/serving/serve.py result files?)")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        return run_compare(args, parser)
    if args.labels:
        parser.error("--labels only goes with --compare")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    wcfg = workload_config(args)
    try:
        wcfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    args.base_url = args.base_url.rstrip("/")
    try:
        info = asyncio.run(server_info(args.base_url))
    except ConnectionError as exc:
        print(f"bench/serving/serve.py: error: {exc}", file=sys.stderr)
        return 2
    if args.model:
        info["model"] = args.model
    longest = max(s.max_context() for s in build_workload(wcfg))
    if info["max_model_len"] and longest > info["max_model_len"]:
        print(f"bench/serving/serve.py: error: the workload needs up to {longest} tokens of context (prompt + output) but "
              f"the server's max_model_len is {info['max_model_len']}; shorten --input-len / --output-len / "
              "--prefix-len / --num-turns", file=sys.stderr)
        return 2
    if args.warmup:
        done, failed = asyncio.run(run_warmup(args, wcfg, info))
        print(f"warm-up: {done} requests done, {failed} failed (not measured)", flush=True)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    name = args.result_name or f"{wcfg.kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    runs = []
    for index, rate in enumerate(args.request_rate):
        result = asyncio.run(run_one(args, wcfg, info, rate, index))
        stem = f"{name}-rate{_rate_tag(rate)}"
        written = [_write_json(args.result_dir / f"{stem}.json", result)]
        if not args.no_plots:
            from serve_plots import plot_cdfs

            written.append(plot_cdfs(result, args.result_dir / f"{stem}-cdf.png"))
        runs.append({"request_rate": result["config"]["request_rate"], "file": written[0].name,
                     "metrics": result["metrics"]})
        print(format_summary(result))
        print("wrote " + ", ".join(str(p) for p in written), flush=True)
    if len(runs) > 1:
        config = {k: v for k, v in result["config"].items() if k != "request_rate"}
        sweep = {"version": RESULT_VERSION, "config": config, "runs": runs}
        written = [_write_json(args.result_dir / f"{name}-sweep.json", sweep)]
        if not args.no_plots:
            from serve_plots import plot_sweep

            written.append(plot_sweep(sweep, args.result_dir / f"{name}-sweep.png"))
        print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r["metrics"]["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
