"""PNG plots of serving-benchmark results (matplotlib, Agg backend): latency CDFs of one run, metrics against
the request rate of a sweep, and several results (runs or sweeps) side by side."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e latency"))


def _save(fig: plt.Figure, path: Path) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_samples_ms(result: dict, key: str) -> list[float]:
    """Per-request TTFT / e2e, or every ITL gap, of the successful requests of a run result (ms)."""
    ok = [r for r in result["requests"] if r["success"]]
    if key == "itl":
        return [g * 1000.0 for r in ok for g in r["itl"]]
    return [r[key] * 1000.0 for r in ok if r.get(key) is not None]


def _cdf(ax, values: list[float], label: str | None = None) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_cdfs(result: dict, path: Path) -> Path:
    """TTFT, ITL and e2e latency CDFs of one run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, title) in zip(axes, LATENCIES):
        _cdf(ax, latency_samples_ms(result, key))
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(_title(result))
    return _save(fig, path)


def _title(result: dict) -> str:
    c = result["config"]
    return f"{c['workload']} @ {c['request_rate']} req/s ({c['arrival']}), {result['metrics']['completed']} requests"


def _rate_label(rate: float | str) -> str:
    return "inf" if rate in ("inf", float("inf")) else f"{float(rate):g}"


def _latency_lines(ax, runs: list[dict], xs: list[int], prefix: str = "") -> None:
    for color, (key, name) in enumerate((("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))):
        for q, style in (("p50", "-"), ("p99", "--")):
            ys = [r["metrics"][key][q] for r in runs]
            ys = [float("nan") if y is None else y for y in ys]
            ax.plot(xs, ys, style, color=f"C{color}", marker="o", label=f"{prefix}{name} {q}")


def plot_sweep(sweep: dict, path: Path) -> Path:
    """Request and output-token throughput and TTFT / TPOT / ITL percentiles against the request rate."""
    runs = sweep["runs"]
    xs = list(range(len(runs)))
    labels = [_rate_label(r["request_rate"]) for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, title in ((axes[0], "request_throughput", "requests/s"),
                           (axes[1], "output_throughput", "output tokens/s")):
        ax.plot(xs, [r["metrics"][key] for r in runs], marker="o")
        ax.set(title=f"{title} vs request rate", ylabel=title)
    _latency_lines(axes[2], runs, xs)
    axes[2].set(title="latency vs request rate", ylabel="ms", yscale="log")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{sweep['config']['workload']} sweep ({sweep['config']['arrival']} arrivals)")
    return _save(fig, path)


def plot_compare(results: list[dict], labels: list[str], path: Path) -> Path:
    """Several run results (bars and overlaid CDFs) or several sweeps (lines against the rate) side by side."""
    sweeps = ["runs" in r for r in results]
    if any(sweeps) and not all(sweeps):
        raise ValueError("--compare takes either run results or sweep results, not a mix")
    if all(sweeps):
        return _compare_sweeps(results, labels, path)
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    width = 0.8 / len(results)
    # throughput
    ax = axes[0][0]
    keys = ("request_throughput", "output_throughput", "total_token_throughput")
    for i, (res, label) in enumerate(zip(results, labels)):
        ax.bar([k + i * width for k in range(len(keys))], [res["metrics"][k] for k in keys], width, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], ["req/s", "output tok/s", "total tok/s"])
    ax.set(title="throughput", yscale="log")
    # latency percentiles
    ax = axes[0][1]
    cols = [(k, q) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for q in ("p50", "p99")]
    for i, (res, label) in enumerate(zip(results, labels)):
        ys = [res["metrics"][k][q] or 0.0 for k, q in cols]
        ax.bar([c + i * width for c in range(len(cols))], ys, width, label=label)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cols))],
                  [f"{k[:-3].upper()}\n{q}" for k, q in cols], fontsize=8)
    ax.set(title="latency (ms)", yscale="log")
    # prefix hits and acceptance length
    ax = axes[0][2]
    for i, (res, label) in enumerate(zip(results, labels)):
        m = res["metrics"]
        ys = [m.get("prefix_hit_ratio") or 0.0, m.get("spec_acceptance_length") or 0.0]
        ax.bar([c + i * width for c in range(2)], ys, width, label=label)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(2)], ["prefix hit ratio", "spec acceptance length\n(0: n/a)"])
    ax.set_title("prefix cache / speculative decoding")
    for ax, (key, title) in zip(axes[1], LATENCIES):
        for res, label in zip(results, labels):
            _cdf(ax, latency_samples_ms(res, key), label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylim=(0, 1.02))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _compare_sweeps(sweeps: list[dict], labels: list[str], path: Path) -> Path:
    rates = [_rate_label(r["request_rate"]) for r in sweeps[0]["runs"]]
    if any([_rate_label(r["request_rate"]) for r in s["runs"]] != rates for s in sweeps):
        raise ValueError("the sweeps to compare must use the same request rates")
    xs = list(range(len(rates)))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for color, (sweep, label) in enumerate(zip(sweeps, labels)):
        axes[0].plot(xs, [r["metrics"]["output_throughput"] for r in sweep["runs"]], color=f"C{color}", marker="o",
                     label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [r["metrics"][key][q] for r in sweep["runs"]]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, color=f"C{color}", marker="o",
                        label=f"{label} {q}")
    axes[0].set(title="output tokens/s", ylabel="tokens/s")
    axes[1].set(title="TTFT", ylabel="ms", yscale="log")
    axes[2].set(title="TPOT", ylabel="ms", yscale="log")
    for ax in axes:
        ax.set_xticks(xs, rates)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)
