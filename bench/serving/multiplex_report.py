"""The multiplexing benchmark's report: the SLO test, the markdown table, the acceptance checks (each multiplexed mode
against co-located, as the one-GPU multiplexing work defines done) and the worker's split metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve_metrics import counters_delta, parse_counters

# the multiplexed worker's split metrics (worker_runtime/worker_metrics.py), read after every point
SPLIT_METRICS = tuple(f"hybridserve_worker_pd_multiplex_{name}{suffix}" for name in (
    "prefill_sms", "decode_sms", "split_changes", "handoffs", "overlapped_decode_steps", "prefills_beside_decode",
    "whole_gpu_steps", "prefill_tokens", "decode_rows")
    for suffix in ("", "_total"))
MULTIPLEXED = ("multiplexed", "multiplexed-lanes", "multiplexed-slo")  # the benchmark's modes that run `--pd-multiplex`


def meets_slo(metrics: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """No failures, something completed, TTFT p99 and TPOT p99 within the SLO."""
    ttft, tpot = metrics["ttft_ms"]["p99"], metrics["tpot_ms"]["p99"]
    return (metrics["completed"] > 0 and metrics["failed"] == 0 and ttft is not None and tpot is not None
            and ttft <= slo_ttft_ms and tpot <= slo_tpot_ms)


def pair_text(metrics: dict[str, Any], key: str) -> str:
    d = metrics[key]
    return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per (point, mode), then goodput per mode and the acceptance checks."""
    lines = ["| point | mode | prompts | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | failed |",
             "|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys(k for m in result["modes"].values() for k in m["points"]))
    for key in keys:
        for mode, data in result["modes"].items():
            point = data["points"].get(key)
            if point is None:
                continue
            m = point["metrics"]
            lines.append(f"| {key} | {mode} | {point['num_prompts']} | {pair_text(m, 'ttft_ms')} | {pair_text(m, 'tpot_ms')} | "
                         f"{pair_text(m, 'itl_ms')} | {m['output_throughput']:,.0f} | {m['failed']} |")
    lines += ["", "| mode | goodput req/s (2048/256, TTFT p99 <= "
              f"{result['slo']['ttft_ms']:g} ms, TPOT p99 <= {result['slo']['tpot_ms']:g} ms) | skipped |", "|---|---|---|"]
    for mode, data in result["modes"].items():
        g = data.get("goodput")
        goodput = "-" if g is None else f"{g['goodput_rps']:g}"
        lines.append(f"| {mode} | {goodput} | {', '.join(data['skipped']) or '-'} |")
    for mux in MULTIPLEXED:
        splits = {k: p["pd_multiplex"] for k, p in result["modes"].get(mux, {}).get("points", {}).items()
                  if p.get("pd_multiplex")}
        if splits:
            lines += ["", f"| point ({mux}) | split after it | split changes so far | handoffs so far | "
                      "whole-GPU steps so far | prompt tokens by prefill SMs | decode rows by decode SMs |",
                      "|---|---|---|---|---|---|---|"]
            points = result["modes"][mux]["points"]
            for key, m in splits.items():
                split = f"{m.get('prefill_sms', 0):.0f}P/{m.get('decode_sms', 0):.0f}D"
                work = points[key].get("lane_work", {})
                lines.append(f"| {key} | {split} | {m.get('split_changes', 0):.0f} | {m.get('handoffs', 0):.0f} | "
                             f"{m.get('whole_gpu_steps', 0):.0f} | "
                             f"{lane_work_text(work, 'prefill_tokens', 'P')} | {lane_work_text(work, 'decode_rows', 'D')} |")
    checks = result.get("checks") or {}
    if checks:
        lines += ["", "| check (against co-located) | value | goal | met |", "|---|---|---|---|"]
        for name, c in checks.items():
            value = "-" if c["value"] is None else f"{c['value']:.2f}"
            lines.append(f"| {name} | {value} | {c['goal']} | {'-' if c['met'] is None else ('yes' if c['met'] else 'no')} |")
    return "\n".join(lines) + "\n"


def acceptance_checks(modes: dict[str, Any]) -> dict[str, Any]:
    """The multiplexing goals this run can compute, each multiplexed mode against co-located (None where a point is
    missing); a check of another multiplexed mode than "multiplexed" has its name prefixed with the mode's."""
    out: dict[str, Any] = {}
    for mux in MULTIPLEXED:
        if mux in modes:
            prefix = "" if mux == "multiplexed" else f"{mux}: "
            out.update({prefix + name: c for name, c in _checks(modes[mux], modes.get("colocated", {})).items()})
    if not out:  # no multiplexed mode ran: the checks, with no values
        out = _checks({}, modes.get("colocated", {}))
    return out


def _checks(mux_mode: dict[str, Any], col_mode: dict[str, Any]) -> dict[str, Any]:
    mux, col = mux_mode.get("points", {}), col_mode.get("points", {})

    def metric(points: dict[str, Any], key: str, name: str, q: str | None) -> float | None:
        point = points.get(key)
        if point is None:
            return None
        value = point["metrics"][name] if q is None else point["metrics"][name][q]
        return None if value is None else float(value)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def check(value: float | None, goal: str, ok: Callable[[float], bool]) -> dict[str, Any]:
        return {"value": value, "goal": goal, "met": None if value is None else ok(value)}

    out = {
        "ITL p99 / p50 at 2048/256@4": check(ratio(metric(mux, "2048/256@4", "itl_ms", "p99"),
                                                   metric(mux, "2048/256@4", "itl_ms", "p50")), "<= 1.5", lambda v: v <= 1.5),
    }
    for key in ("512/128@8", "2048/256@4"):
        out[f"TTFT p50 vs co-located at {key}"] = check(ratio(metric(mux, key, "ttft_ms", "p50"),
                                                              metric(col, key, "ttft_ms", "p50")), "<= 1.1", lambda v: v <= 1.1)
    for key in ("512/128@all", "2048/256@all"):
        out[f"output tok/s vs co-located at {key}"] = check(
            ratio(metric(mux, key, "output_throughput", None), metric(col, key, "output_throughput", None)),
            ">= 1.0", lambda v: v >= 1.0)
    g_mux = (mux_mode.get("goodput") or {}).get("goodput_rps")
    g_col = (col_mode.get("goodput") or {}).get("goodput_rps")
    out["goodput vs co-located"] = check(ratio(g_mux, g_col), ">= 1.5", lambda v: v >= 1.5)
    return out


def split_metrics(text: str) -> dict[str, float]:
    """The multiplexed worker's split metrics in a Prometheus text (names without their common prefix); a lane's
    work by its SM count under `prefill_tokens:<SMs>` and `decode_rows:<SMs>`."""
    prefix = "hybridserve_worker_pd_multiplex_"
    out = {}
    for key, value in parse_counters(text, SPLIT_METRICS).items():
        name, sep, sms = key.partition(":")
        out[name.removeprefix(prefix).removesuffix("_total") + sep + sms] = value
    return out


def lane_work(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A point's prefill tokens and decode rows by lane SM count: the by-SMs split metrics after it less before."""
    return {k: v for k, v in counters_delta(before, after).items() if ":" in k and v > 0}


def lane_work_text(work: dict[str, float], kind: str, lane: str) -> str:
    """e.g. "56P 30,720; 112P 2,048" (kind "prefill_tokens", lane "P"): where the point's work ran."""
    parts = sorted((int(k.partition(":")[2]), v) for k, v in work.items() if k.startswith(kind + ":"))
    return "; ".join(f"{sms}{lane} {v:,.0f}" for sms, v in parts) or "-"
