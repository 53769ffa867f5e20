"""One table from the sweeps bench/serving/serve_gpu.sh wrote: per workload and deployment, TTFT / TPOT percentiles
and output throughput at every offered rate, and the ratios the disaggregation targets are stated in. Where the
same run measured the offline engine (serve_gpu.sh OFFLINE_BATCHES: `one_batch-<batch>x<input>.json`), each row
also gets the offline decode step at the batch nearest its served mean batch (outputs per step) and TPOT p50
over it (the serving target: <= 1.5x).

  python bench/serving/serve_table.py OUT     # prints it and writes table.md / table.json there

Committed results keep their large per-request JSONs gzipped (`*.json.gz`): both are read.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

BASELINE = "colocated-1gpu"
KINDS = ("shared-prefix", "multi-turn")  # workloads other than random prompts (serve_gpu.sh KIND)


def results(result_dir: Path, pattern: str) -> list[tuple[str, dict]]:
    """(name without .json / .json.gz, parsed JSON) of the files matching `pattern` + .json or .json.gz."""
    found = []
    for path in sorted([*result_dir.glob(f"{pattern}.json"), *result_dir.glob(f"{pattern}.json.gz")]):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        found.append((path.name.removesuffix(".gz").removesuffix(".json"), json.loads(text)))
    return found


def load(result_dir: Path) -> dict[tuple[str, str], dict[str, dict]]:
    """(deployment, workload) -> {rate tag: metrics}, from `<deployment>-<in>-<out>[-<pass>]-sweep.json` (several
    rates) and `...-rate<R>.json` (one rate) files; a pass (cold / warm) is kept in the deployment's label."""
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for stem, result in results(result_dir, "*"):
        if stem.endswith("-sweep"):
            runs = result["runs"]
            name = stem.removesuffix("-sweep")
        elif "-rate" in stem:
            runs = [{"request_rate": result["config"]["request_rate"], "metrics": result["metrics"]}]
            name = stem.rsplit("-rate", 1)[0]
        else:
            continue
        parts = name.split("-")
        suffix = ""
        if len(parts) >= 3 and not parts[-1].isdigit() and parts[-2].isdigit():  # PASSES="cold warm", "p1 p2", ...
            suffix = f" ({parts.pop()})"
        deployment, input_len, output_len = "-".join(parts[:-2]), parts[-2], parts[-1]
        if not (input_len.isdigit() and output_len.isdigit()):
            continue
        kind = next((k for k in KINDS if deployment.endswith(f"-{k}")), "")  # serve_gpu.sh KIND=...: its own workload
        deployment = deployment.removesuffix(f"-{kind}") + suffix if kind else deployment + suffix
        workload = f"{kind} {input_len}/{output_len}" if kind else f"{input_len}/{output_len}"
        by_rate = table.setdefault((deployment, workload), {})
        for r in runs:
            by_rate.setdefault(_tag(r["request_rate"]), r["metrics"])
    return table


def offline_steps(result_dir: Path) -> dict[tuple[int, int], float]:
    """(input length, batch) -> the offline engine's decode step p50 in ms, from bench/system/one_batch.py's JSONs."""
    steps = {}
    for _, result in results(result_dir, "one_batch-*"):
        steps[(int(result["input_len"]), int(result["batch"]))] = float(result["decode_step_ms_p50"])
    return steps


def nearest_offline(steps: dict[tuple[int, int], float], input_len: int, mean_batch: float | None) -> float | None:
    """The offline decode step for this input length at the measured batch nearest the served mean batch (the
    larger on a tie: a bigger batch's step is the slower, so the ratio errs against us); None without one."""
    batches = [b for (n, b) in steps if n == input_len]
    if not batches or mean_batch is None:
        return None
    batch = min(batches, key=lambda b: (abs(b - mean_batch), -b))
    return steps[(input_len, batch)]


def _tag(rate: object) -> str:
    return "inf" if rate in (None, "inf", float("inf")) or (isinstance(rate, str) and "inf" in rate) else f"{float(rate):g}"


def rows(table: dict[tuple[str, str], dict[str, dict]], offline: dict[tuple[int, int], float] | None = None) -> list[dict]:
    out = []
    for (deployment, workload), by_rate in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        input_len = int(workload.split()[-1].split("/")[0])
        for rate, m in sorted(by_rate.items(), key=lambda kv: float("inf") if kv[0] == "inf" else float(kv[0])):
            step = nearest_offline(offline or {}, input_len, m.get("engine_outputs_per_step"))
            tpot = m["tpot_ms"]["p50"]
            out.append({
                "workload": workload, "deployment": deployment, "rate": rate, "completed": m["completed"],
                "failed": m["failed"], "request_throughput": m["request_throughput"],
                "output_throughput": m["output_throughput"], "ttft_p50_ms": m["ttft_ms"]["p50"],
                "ttft_p99_ms": m["ttft_ms"]["p99"], "tpot_p50_ms": m["tpot_ms"]["p50"],
                "tpot_p99_ms": m["tpot_ms"]["p99"], "itl_p99_ms": m["itl_ms"]["p99"],
                "engine_step_ms": m.get("engine_step_ms_mean"), "engine_gap_ms": m.get("engine_gap_ms_mean"),
                "outputs_per_step": m.get("engine_outputs_per_step"), "offline_step_ms": step,
                "tpot_over_offline": tpot / step if step and tpot is not None else None,
            })
    return out


def _ok(m: dict) -> bool:
    return bool(m["completed"]) and m["ttft_ms"]["p50"] is not None


def _goodput_rate(runs: dict[str, dict]) -> float:
    """The highest offered rate whose requests all finished with TPOT p99 <= 15 ms (0: none)."""
    ok = [float(r) for r, m in runs.items() if r != "inf" and m["tpot_ms"]["p99"] <= 15 and not m["failed"]]
    return max(ok, default=0.0)


def targets(table: dict[tuple[str, str], dict[str, dict]]) -> list[str]:
    """The issue's done-when ratios against the co-located single-GPU worker, per workload and P/D plane."""
    lines = []
    for (deployment, workload), by_rate in sorted(table.items()):
        base = table.get((BASELINE, workload))
        if not deployment.startswith("pd-2gpu") or base is None:
            continue
        parts = []
        by_rate = {r: m for r, m in by_rate.items() if _ok(m)}
        base = {r: m for r, m in base.items() if _ok(m)}
        if "inf" in by_rate and "inf" in base:
            parts.append(f"all-at-once output {by_rate['inf']['output_throughput'] / base['inf']['output_throughput']:.2f}x "
                         "(target >= 1.8x)")
        if "8" in by_rate and "8" in base:
            delta = by_rate["8"]["ttft_ms"]["p50"] - base["8"]["ttft_ms"]["p50"]
            parts.append(f"TTFT p50 @8 {delta:+.0f} ms vs co-located (target <= +25 ms)")
        if "16" in by_rate and "16" in base:
            parts.append(f"TPOT p50 @16 {by_rate['16']['tpot_ms']['p50'] / base['16']['tpot_ms']['p50']:.2f}x "
                         "(target <= 0.8x)")
        dp = table.get(("colocated-2gpu-dp", workload))
        if dp is not None:
            dp = {r: m for r, m in dp.items() if _ok(m)}
            parts.append(f"highest rate with TPOT p99 <= 15 ms: P/D {_goodput_rate(by_rate):g} "
                         f"vs 2 co-located {_goodput_rate(dp):g} req/s")
        lines.append(f"- {workload} {deployment}: " + "; ".join(parts))
    return lines


def markdown(all_rows: list[dict], target_lines: list[str]) -> str:
    head = ("| workload | deployment | rate | done | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| ITL p99 | step ms | gap ms | out/step | offline step ms | TPOT / offline |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['workload']} | {r['deployment']} | {r['rate']} | {r['completed']}/{r['completed'] + r['failed']} "
        f"| {_num(r['request_throughput'], '.2f')} | {_num(r['output_throughput'], '.0f')} "
        f"| {_num(r['ttft_p50_ms'], '.0f')} | {_num(r['ttft_p99_ms'], '.0f')} | {_num(r['tpot_p50_ms'], '.1f')} "
        f"| {_num(r['tpot_p99_ms'], '.1f')} | {_num(r['itl_p99_ms'], '.1f')} | {_num(r['engine_step_ms'], '.2f')} "
        f"| {_num(r['engine_gap_ms'], '.2f')} | {_num(r['outputs_per_step'], '.1f')} "
        f"| {_num(r['offline_step_ms'], '.2f')} | {_num(r['tpot_over_offline'], '.2f')} |\n" for r in all_rows)
    return head + body + "\n" + "\n".join(target_lines) + "\n"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    result_dir = Path(argv[0])
    table = load(result_dir)
    all_rows, target_lines = rows(table, offline_steps(result_dir)), targets(table)
    text = markdown(all_rows, target_lines)
    print(text)
    (result_dir / "table.md").write_text(text)
    (result_dir / "table.json").write_text(json.dumps({"rows": all_rows, "targets": target_lines}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
