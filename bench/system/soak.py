"""Soak: mixed streaming traffic for a long time with one fault a minute; not part of CI.

Runs the chaos harness (bench/system/chaos.py: a router over in-process workers plus decode worker processes) for
--minutes, injecting in turn: SIGKILL of a decode worker process (a new one is started), a prefill worker
dying (replaced), SIGSTOP of a decode worker process for 10 s, a corrupted state transfer. Requests leave
mid-stream on their own (every 7th). RSS of every process is sampled every --sample-s seconds.

Report: requests by outcome (lost = wrong tokens, broken connections, unclean errors; must be 0), RSS growth
per hour after the warm-up (the first --warmup-minutes) for each process (target < 5 %), the idle check
after the run. Prints a table and writes JSON (--out).

    PYTHONPATH=.pylink python bench/system/soak.py --minutes 30 --out bench/results/cpu/faults/soak.json      # the soak
    PYTHONPATH=.pylink python bench/system/soak.py --minutes 1 --warmup-minutes 0.2 --out /tmp/soak.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "tests"),
                str(Path(__file__).resolve().parents[2] / "tests" / "router")]  # the harness and the test cluster

from chaos import ChaosSystem, Outcomes  # noqa: E402
from router_cluster import tiny_model_dir  # noqa: E402

from hybridserve.prefill_worker.worker import PrefillWorker  # noqa: E402

logger = logging.getLogger("soak")


def _replace_prefill(system: ChaosSystem) -> None:
    """A dead in-process prefill worker is replaced by a new one (what Ray's restart does)."""
    dead = [w for w in system.cluster.prefill if w._server is None]
    for w in dead:
        w.stop(grace=0)
        system.cluster.prefill.remove(w)
        fresh = PrefillWorker(system.model_dir, w.engine.config, worker_id=f"{w.worker_id}r",
                              transfer=w.transfer, internal_token=w._internal_token)
        fresh.start()
        system.cluster.prefill.append(fresh)


def _fault(system: ChaosSystem, k: int) -> str:
    kind = k % 4
    if kind == 0:
        system.kill_decode_process()
        system.start_decode_process(f"soak-d{k}")
        return "SIGKILL decode process (restarted)"
    if kind == 1:
        system.kill_prefill()
        _replace_prefill(system)
        system.route()
        return "prefill worker died (replaced)"
    if kind == 2:
        system.stop_process_for(10.0)
        return "SIGSTOP decode process 10 s"
    system.corrupt_next_transfer().wait(timeout=30)
    return "corrupted transfer"


def _growth_per_hour(samples: list[tuple[float, dict[str, int]]], warmup_s: float) -> dict[str, float]:
    """Least-squares slope of each process's RSS after the warm-up, as % of its first post-warm-up value per hour."""
    out: dict[str, float] = {}
    names = set().union(*(s for _, s in samples)) if samples else set()
    for name in names:
        points = [(t, s[name]) for t, s in samples if t >= warmup_s and name in s]
        if len(points) < 3:
            continue
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_r = sum(r for _, r in points) / n
        var = sum((t - mean_t) ** 2 for t, _ in points)
        slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / var if var else 0.0  # bytes / s
        out[name] = 100.0 * slope * 3600.0 / points[0][1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--fault-every-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)

    system = ChaosSystem(tiny_model_dir())
    outcomes, faults, samples = Outcomes(), [], []
    try:
        system.start_decode_process("soak-d0")
        system.start_decode_process("soak-d1")
        system.reference()
        stop = threading.Event()
        clients = [threading.Thread(target=system.load, args=(stop, outcomes, seed), daemon=True)
                   for seed in range(args.clients)]
        start = time.monotonic()
        for t in clients:
            t.start()
        next_fault, next_sample, k = start + args.fault_every_s, start, 0
        while (now := time.monotonic()) < start + args.minutes * 60:
            if now >= next_sample:
                samples.append((now - start, system.rss_bytes()))
                next_sample += args.sample_s
            if now >= next_fault:
                what = _fault(system, k)
                faults.append({"t_s": round(now - start, 1), "fault": what})
                logger.info("t=%.0f s fault %d: %s; outcomes %s", now - start, k, what, dict(outcomes.counts))
                k += 1
                next_fault += args.fault_every_s
            time.sleep(0.2)
        stop.set()
        for t in clients:
            t.join(timeout=120)
        problems = system.settle()
        after = {i: system.request(i) == ("done", e) for i, e in system.expected.items()}
    finally:
        system.stop()

    lost = sum(v for kind, v in outcomes.counts.items() if kind not in ("exact", "error", "disconnected"))
    growth = _growth_per_hour(samples, args.warmup_minutes * 60)
    report = {
        "host": platform.node(), "python": platform.python_version(), "minutes": args.minutes,
        "clients": args.clients, "faults": faults, "outcomes": dict(outcomes.counts), "lost": lost,
        "lost_examples": outcomes.bad[:20], "rss_growth_pct_per_hour": growth,
        "rss_first_last_bytes": {n: [next((s[n] for _, s in samples if n in s), 0),
                                     next((s[n] for _, s in reversed(samples) if n in s), 0)] for n in growth},
        "idle_problems_after": problems, "exact_after": all(after.values()),
    }
    print(f"{'outcome':<14}{'requests':>10}")
    for kind, count in sorted(outcomes.counts.items()):
        print(f"{kind:<14}{count:>10}")
    print(f"lost: {lost}   faults injected: {len(faults)}   idle afterwards: {not problems}   "
          f"exact afterwards: {report['exact_after']}")
    print(f"{'process':<16}{'RSS growth %/h':>16}")
    for name, pct in sorted(growth.items()):
        print(f"{name:<16}{pct:>16.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if lost == 0 and not problems and report["exact_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
