"""Prefill/decode multiplexing on one GPU: co-located vs `--pd-multiplex` vs the two-process pair, same workloads.

For each mode, starts one `hybridserve serve --no-ray --load-format dummy` on GPU 0 (random weights of the
config's shapes) and runs, through the OpenAI streaming client of bench/serving/:
- random prompts 512/128 and 2048/256 at each --rates (Poisson) and all at once (64 and 48 prompts);
- the goodput search: the highest Poisson rate of 2048/256 with TTFT p99 <= --slo-ttft-ms and TPOT p99 <=
  --slo-tpot-ms (and no failed request), from the sweep's own 2048/256 points, then doubling / bisecting.

    python bench/serving/multiplex.py --out bench/results/h200/multiplex/serving      # ~9 min on an H200
    python bench/serving/multiplex.py --modes colocated,multiplexed --budget-s 200 --point-s 5 --out /tmp/mx

Modes: colocated (`--prefill-workers 0 --decode-workers 1`), multiplexed (the same plus `--pd-multiplex`),
multiplexed-lanes (`--pd-multiplex --no-pd-multiplex-whole-gpu`: every step in the split's lanes, never a whole-GPU
step), multiplexed-slo (`--pd-multiplex --pd-multiplex-tpot-slo-ms`: the split keeps the decode step within a TPOT
budget rather than within 1.3x of its fastest), pair (`--prefill-workers 1 --decode-workers 1 --gpus 0,0`: two
processes on one GPU). Every worker gets `--gpu-memory-gb` (default 40) and `--max-num-seqs` (default 64);
everything after `--` goes to every server.
The run fits a device budget: each point sends --point-s seconds of arrivals (at least --min-prompts), the
points run most important first (the ones the acceptance checks name), and a point that would end past its mode's
share of --budget-s (counted from the server's /ready) is skipped and listed. Wall time is about --budget-s plus
a start-up per mode (the first one compiles the Triton kernels: 1-2 min on a cold cache). Writes
OUT/multiplex.json and OUT/table.md and prints the table and the acceptance checks (each multiplexed mode against
co-located). The default --modes runs all five, so each gets a fifth of --budget-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from multiplex_report import acceptance_checks, lane_work, meets_slo, pair_text, split_metrics, table  # noqa: E402
from serve_client import ClientConfig, metrics_texts, metrics_urls, run_with_metrics, server_info  # noqa: E402
from serve_metrics import summarize  # noqa: E402
from serve_workloads import WorkloadConfig, arrival_offsets, build_workload  # noqa: E402
from throughput import Server, measure_copy_gbps  # noqa: E402

logger = logging.getLogger("multiplex")

MODES = {  # serve flags per mode, after throughput.Server's own (--prefill-workers 0 --decode-workers 1)
    "colocated": [],
    "multiplexed": ["--pd-multiplex"],
    "multiplexed-lanes": ["--pd-multiplex", "--no-pd-multiplex-whole-gpu"],  # the lanes alone, no whole-GPU steps
    # the split's decode budget a TPOT SLO instead of the default 1.3x slowdown (--mux-step-slo-ms is appended)
    "multiplexed-slo": ["--pd-multiplex", "--pd-multiplex-tpot-slo-ms"],
    "pair": ["--prefill-workers", "1", "--decode-workers", "1", "--gpus", "0,0"],
}
WORKLOADS = ((512, 128), (2048, 256))
ALL_AT_ONCE = {(512, 128): 64, (2048, 256): 48}  # prompts sent at once (as in the earlier one-GPU pair measurements)
GOODPUT_SHAPE = (2048, 256)
# the points the acceptance checks read, run first
PRIORITY = (((2048, 256), 4.0), ((512, 128), 8.0), ((512, 128), math.inf), ((2048, 256), math.inf))


@dataclass(frozen=True)
class Point:
    """One measurement: `input_len`/`output_len` random prompts arriving at `rate` per second (inf: at once)."""

    input_len: int
    output_len: int
    rate: float
    num_prompts: int

    @property
    def key(self) -> str:
        return f"{self.input_len}/{self.output_len}@{'all' if math.isinf(self.rate) else f'{self.rate:g}'}"


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive rates, got {text!r}") from None
    if not rates or any(not (r > 0) or math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be finite and > 0 (all-at-once points always run), got {text!r}")
    return rates


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {', '.join(MODES)}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/serving/multiplex.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=HERE.parent / "configs" / "nemotron-nano-9b-v2.json",
                   help="the model's config.json (dummy weights)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--rates", type=_rates, default=[4.0, 8.0, 16.0], help="Poisson rates, req/s (default 4,8,16)")
    p.add_argument("--point-s", type=float, default=8.0, help="seconds of arrivals per Poisson point (the BUDGET knob)")
    p.add_argument("--min-prompts", type=int, default=16, help="prompts per Poisson point at least")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds of measuring for the whole run (server start-ups not counted: the first one also "
                        "compiles the Triton kernels, 1-2 min); each mode gets an equal share, points past it are skipped")
    p.add_argument("--goodput-steps", type=int, default=3, help="extra goodput probes beyond the sweep's points")
    p.add_argument("--goodput-max-rate", type=float, default=64.0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=20.0)
    p.add_argument("--mux-step-slo-ms", type=float, default=15.0,
                   help="multiplexed-slo: the decode step budget the split keeps (below --slo-tpot-ms: host and "
                        "handoff time come on top)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-gb", type=float, default=40.0, help="state-cache budget of every worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, required=True, help="folder for multiplex.json, table.md and server logs")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, extra server flags after `--`); exits with a usage error on bad options."""
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = build_parser()
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    for name in ("point_s", "budget_s", "slo_ttft_ms", "slo_tpot_ms", "mux_step_slo_ms", "gpu_memory_gb",
                 "goodput_max_rate"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.min_prompts < 1 or args.goodput_steps < 0 or args.max_num_seqs < 1:
        parser.error("--min-prompts and --max-num-seqs must be >= 1, --goodput-steps >= 0")
    return args, server_args


def plan_points(rates: list[float], point_s: float, min_prompts: int) -> list[Point]:
    """Every point of one mode, the acceptance checks' points first, then by shape and rate."""
    def make(shape: tuple[int, int], rate: float) -> Point:
        n = ALL_AT_ONCE[shape] if math.isinf(rate) else max(min_prompts, math.ceil(rate * point_s))
        return Point(shape[0], shape[1], rate, n)

    wanted = [(s, r) for s in WORKLOADS for r in (*rates, math.inf)]
    ordered = [p for p in PRIORITY if p in wanted] + [p for p in wanted if p not in PRIORITY]
    return [make(s, r) for s, r in ordered]


def goodput_search(known: dict[float, bool], probe: Callable[[float], bool | None], steps: int, max_rate: float
                   ) -> dict[str, Any]:
    """The highest passing rate: from the rates already measured (`known`: rate -> met the SLO), double past the
    highest passing one while all pass, else bisect between it and the lowest failing one; `steps` probes at most
    (`probe` returns None when the budget ran out). Returns the goodput (0 when nothing passed) and the probes."""
    results = dict(known)
    probes: list[dict[str, Any]] = []
    for _ in range(steps):
        passing = [r for r, ok in results.items() if ok]
        failing = [r for r, ok in results.items() if not ok]
        lo = max(passing, default=0.0)
        above = [r for r in failing if r > lo]
        if above:
            hi = min(above)
            if hi - lo <= max(0.5, 0.1 * hi):
                break
            rate = (lo + hi) / 2 if lo else hi / 2
        else:
            if lo >= max_rate:
                break
            rate = min(max_rate, lo * 2) if lo else 1.0
        ok = probe(rate)
        if ok is None:
            break
        results[rate] = ok
        probes.append({"rate": rate, "meets_slo": ok})
    passing = [r for r, ok in results.items() if ok]
    return {"goodput_rps": max(passing, default=0.0), "probes": probes,
            "rates": {f"{r:g}": ok for r, ok in sorted(results.items())}}


def gpu_check() -> str | None:
    """Why this cannot run here (no CUDA GPU), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (this benchmark starts GPU servers; run it on a GPU machine)"
    return None


class ModeRun:
    """One mode's server and its points."""

    def __init__(self, mode: str, args: argparse.Namespace, server_args: list[str], model_dir: Path, share_s: float):
        self.mode, self.args, self.share_s = mode, args, share_s
        self.deadline = math.inf  # set once the server is ready: its start-up is not part of the budget
        slo = [f"{args.mux_step_slo_ms:g}"] if mode == "multiplexed-slo" else []
        self.flags = [*MODES[mode], *slo, "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-gb",
                      str(args.gpu_memory_gb), *server_args]
        self.model_dir = model_dir
        self.points: dict[str, Any] = {}
        self.skipped: list[str] = []
        self.index = 0
        self.base_url = f"http://127.0.0.1:{args.port}"
        self.model = ""

    def fits(self, point: Point) -> bool:
        """Whether the point (its arrivals, plus a drain of the same length) ends before the mode's deadline."""
        span = 0.0 if math.isinf(point.rate) else point.num_prompts / point.rate
        return time.monotonic() + 2 * span + 10 < self.deadline

    def measure(self, point: Point) -> dict[str, Any] | None:
        if not self.fits(point):
            self.skipped.append(point.key)
            return None
        self.index += 1
        wcfg = WorkloadConfig(kind="random", num_prompts=point.num_prompts, input_len=point.input_len,
                              output_len=point.output_len, token_range=(3, 30000), seed=self.args.seed,
                              id_seed=self.index)
        sessions = build_workload(wcfg)
        offsets = arrival_offsets(len(sessions), point.rate, "poisson", self.args.seed + self.index)
        ccfg = ClientConfig(base_url=self.base_url, model=self.model, ignore_eos=True,
                            timeout_s=self.args.request_timeout)
        urls = asyncio.run(metrics_urls(self.base_url, []))
        multiplexed = self.mode.startswith("multiplexed")
        before = split_metrics("\n".join(asyncio.run(metrics_texts(urls)))) if multiplexed else {}
        records, duration, delta = asyncio.run(run_with_metrics(ccfg, sessions, offsets, urls))
        metrics = summarize(records, duration, delta)
        entry = {"input_len": point.input_len, "output_len": point.output_len,
                 "rate": "inf" if math.isinf(point.rate) else point.rate, "num_prompts": point.num_prompts,
                 "metrics": metrics}
        if multiplexed:  # the split in effect after the point, the changes so far, where the point's work ran
            after = split_metrics("\n".join(asyncio.run(metrics_texts(urls))))
            entry["pd_multiplex"] = {k: v for k, v in after.items() if ":" not in k}
            entry["lane_work"] = lane_work(before, after)
        self.points[point.key] = entry
        m = metrics
        logger.info("%s %s: TTFT p50/p99 %s, TPOT %s, ITL %s, %.0f tok/s, %d failed", self.mode, point.key,
                    pair_text(m, "ttft_ms"), pair_text(m, "tpot_ms"), pair_text(m, "itl_ms"), m["output_throughput"], m["failed"])
        return entry

    def run(self) -> dict[str, Any]:
        a = self.args
        log = a.out / f"{self.mode}.server.log"
        server = Server(self.model_dir, a.port, self.flags, log)
        out: dict[str, Any] = {"server_flags": self.flags, "server_log": log.name}
        try:
            started = time.monotonic()
            if not server.wait_ready(a.ready_timeout):
                out.update(error=f"the server did not come up in {a.ready_timeout:g} s: see {log.name}", points={},
                           skipped=["all"])
                return out
            out["startup_s"] = round(time.monotonic() - started, 1)
            self.deadline = time.monotonic() + self.share_s
            self.model = asyncio.run(server_info(self.base_url))["model"]
            for point in plan_points(a.rates, a.point_s, a.min_prompts):
                self.measure(point)
            known = {p["rate"]: meets_slo(p["metrics"], a.slo_ttft_ms, a.slo_tpot_ms) for p in self.points.values()
                     if (p["input_len"], p["output_len"]) == GOODPUT_SHAPE and p["rate"] != "inf"}

            def probe(rate: float) -> bool | None:
                n = max(a.min_prompts, math.ceil(rate * a.point_s))
                entry = self.measure(Point(*GOODPUT_SHAPE, rate, n))
                return None if entry is None else meets_slo(entry["metrics"], a.slo_ttft_ms, a.slo_tpot_ms)

            out["goodput"] = goodput_search(known, probe, a.goodput_steps, a.goodput_max_rate)
        finally:
            server.stop()
        out.update(points=self.points, skipped=self.skipped)
        return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_tree(repo: Path = HERE.parent.parent) -> str | None:
    """The git tree id of the files this run read: a scratch index over the working tree (untracked files git does
    not ignore included), so a copied tree whose HEAD is older still names its content; `git rev-parse C^{tree}`
    gives the same id for the commit C holding these files. None outside a git checkout."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        try:
            for command in (["git", "add", "-A"], ["git", "write-tree"]):
                done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=60)
                if done.returncode != 0:
                    return None
        except (OSError, subprocess.SubprocessError):
            return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, server_args = parse_args(argv)
    why = gpu_check()
    if why is not None:
        print(f"bench/serving/multiplex.py: cannot run: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through `finally`: servers go down with us
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    config_json = json.loads(args.config.read_text())
    # "commit": the checkout's HEAD; "tree": what ran (they differ where the working tree was copied onto a checkout)
    result: dict[str, Any] = {"config": args.config.name, "commit": git_commit(), "tree": source_tree(), "argv": argv,
                              "copy_GBps": measure_copy_gbps(), "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                              "modes": {}}
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config_json))
        for mode in args.modes:
            share = args.budget_s / len(args.modes)
            result["modes"][mode] = ModeRun(mode, args, server_args, Path(model_dir), share).run()
            (args.out / "multiplex.json").write_text(json.dumps(result, indent=1) + "\n")
    result["checks"] = acceptance_checks(result["modes"])
    result["wall_s"] = round(time.monotonic() - start, 1)
    (args.out / "multiplex.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (args.out / "table.md").write_text(text)
    print(text, flush=True)
    return 0 if all("error" not in m for m in result["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
