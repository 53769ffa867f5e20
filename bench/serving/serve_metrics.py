"""Metrics of the serving benchmark: per-request records, their summary, and Prometheus counter deltas.

Definitions follow vLLM's benchmark_serving: TTFT = first streamed token - send; e2e = last chunk - send;
TPOT = (e2e - TTFT) / (output tokens - 1) for requests with more than one output token; ITL = the gaps
between successive streamed chunks that carry tokens (a chunk with several tokens is one gap). Latencies are
reported in milliseconds; throughputs over the run's wall time (first send to last completion).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SPEC_ACCEPTED = "hybridserve_worker_spec_accepted_tokens_total"
SPEC_STEPS = "hybridserve_worker_spec_verify_steps_total"
PREFIX_HIT_TOKENS = "hybridserve_worker_prefix_cache_hit_tokens_total"
PREFIX_QUERIES = "hybridserve_worker_prefix_cache_queries_total"
PREFIX_HITS = "hybridserve_worker_prefix_cache_hits_total"
ENGINE_STEPS = "hybridserve_worker_engine_steps_total"
ENGINE_STEP_SECONDS = "hybridserve_worker_engine_step_seconds_total"
ENGINE_GAP_SECONDS = "hybridserve_worker_engine_gap_seconds_total"
ENGINE_OUTPUTS = "hybridserve_worker_engine_step_outputs_total"
ENGINE_GAPS = "hybridserve_worker_engine_gaps_total"
GRAPH_STEPS = "hybridserve_worker_engine_graph_decode_steps_total"
EAGER_DECODES = "hybridserve_worker_engine_eager_decode_steps_total"
DECODE_ONLY_STEPS = "hybridserve_worker_engine_decode_only_steps_total"
DECODE_ONLY_SECONDS = "hybridserve_worker_engine_decode_only_step_seconds_total"
DECODE_ONLY_ROWS = "hybridserve_worker_engine_decode_only_rows_total"
DECODE_ONLY_PHASES = "hybridserve_worker_engine_decode_only_phase_seconds_total"  # kept per phase: NAME:phase
GC_PAUSE_SECONDS = "hybridserve_worker_gc_pause_seconds_total"  # kept per generation: NAME:generation
KEPT_LABELS = ("phase", "generation", "prefill_sms", "decode_sms")  # samples with one of these: summed per its value
SCRAPED = (SPEC_ACCEPTED, SPEC_STEPS, PREFIX_HIT_TOKENS, PREFIX_QUERIES, PREFIX_HITS, ENGINE_STEPS,
           ENGINE_STEP_SECONDS, ENGINE_GAP_SECONDS, ENGINE_OUTPUTS, GRAPH_STEPS, EAGER_DECODES, ENGINE_GAPS,
           DECODE_ONLY_STEPS, DECODE_ONLY_SECONDS, DECODE_ONLY_ROWS, DECODE_ONLY_PHASES, GC_PAUSE_SECONDS)


@dataclass
class RequestRecord:
    """What one request did; times in seconds, `start` relative to the run's start."""

    session_id: int
    turn: int
    prompt_len: int
    max_tokens: int
    start: float = 0.0
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    group: int | None = None

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 / max in milliseconds (all None without values)."""
    xs = [v * 1000.0 for v in values_s]
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not xs:
        return {k: None for k in keys}
    out = {"mean": sum(xs) / len(xs)}
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    out["max"] = max(xs)
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, counters_delta: dict[str, float] | None = None
              ) -> dict:
    """The run's metrics from its request records and the Prometheus counter deltas (None: not scraped)."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    metrics: dict = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "failure_reasons": dict(Counter(r.error or "unknown" for r in failed)),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": distribution_ms(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": distribution_ms(t for t in (r.tpot for r in ok) if t is not None),
        "itl_ms": distribution_ms(g for r in ok for g in r.itl),
        "e2e_ms": distribution_ms(r.e2e for r in ok if r.e2e is not None),
    }
    metrics.update(prefix_hit(ok, counters_delta))
    metrics["spec_acceptance_length"] = acceptance_length(counters_delta)
    metrics.update(engine_loop(counters_delta))
    metrics["gc_pause_ms_per_s"] = gc_pauses(counters_delta, dur)
    return metrics


def gc_pauses(counters_delta: dict[str, float] | None, duration_s: float) -> dict[str, float] | None:
    """The workers' garbage-collection pause time per second of the run, by generation (None: not scraped)."""
    if not counters_delta:
        return None
    found = {key.split(":", 1)[1]: 1e3 * value / duration_s for key, value in counters_delta.items()
             if key.startswith(GC_PAUSE_SECONDS + ":")}
    return found or None


def engine_loop(counters_delta: dict[str, float] | None) -> dict:
    """The workers' engine loops over the run, summed over workers: mean step and mean gap between busy steps
    (ms) and outputs per step, so a TPOT far above the step time shows whether the steps or the gaps grew."""
    steps = (counters_delta or {}).get(ENGINE_STEPS, 0.0)
    if not counters_delta or steps <= 0:
        return {"engine_step_ms_mean": None, "engine_gap_ms_mean": None, "engine_outputs_per_step": None,
                "engine_graph_steps": None, "engine_eager_decode_steps": None, "engine_decode_step_ms_mean": None,
                "engine_decode_rows_mean": None, "engine_decode_phase_ms_mean": None}
    decode_steps = counters_delta.get(DECODE_ONLY_STEPS, 0.0)
    return {
        "engine_step_ms_mean": 1e3 * counters_delta.get(ENGINE_STEP_SECONDS, 0.0) / steps,
        # per gap (a gap lies between two back-to-back busy steps); per step where the gap count is not exported
        "engine_gap_ms_mean": 1e3 * counters_delta.get(ENGINE_GAP_SECONDS, 0.0) / (counters_delta.get(ENGINE_GAPS)
                                                                                   or steps),
        "engine_outputs_per_step": counters_delta.get(ENGINE_OUTPUTS, 0.0) / steps,
        "engine_graph_steps": counters_delta.get(GRAPH_STEPS),
        "engine_eager_decode_steps": counters_delta.get(EAGER_DECODES),
        # steps without prompt tokens alone: set beside the offline engine's decode step at the same mean batch
        "engine_decode_step_ms_mean": 1e3 * counters_delta.get(DECODE_ONLY_SECONDS, 0.0) / decode_steps
        if decode_steps else None,
        "engine_decode_rows_mean": counters_delta.get(DECODE_ONLY_ROWS, 0.0) / decode_steps if decode_steps else None,
        # where a decode-only step's time went (schedule, launch, while_running, wait, update), ms per step
        "engine_decode_phase_ms_mean": {
            key.split(":", 1)[1]: 1e3 * value / decode_steps for key, value in counters_delta.items()
            if key.startswith(DECODE_ONLY_PHASES + ":")
        } if decode_steps else None,
    }


def prefix_hit(ok: Sequence[RequestRecord], counters_delta: dict[str, float] | None) -> dict:
    """Prompt tokens served from prefix caches / prompt tokens, from the usage's cached_tokens when the server
    reported it, else from the workers' hit-token counter; None when neither is known."""
    prompt = sum(r.prompt_len for r in ok)
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if ok and len(reported) == len(ok):
        cached, source = sum(reported), "usage"
    elif counters_delta and PREFIX_HIT_TOKENS in counters_delta:
        cached, source = counters_delta[PREFIX_HIT_TOKENS], "prometheus"
    else:
        return {"prefix_hit_ratio": None, "cached_tokens": None, "prefix_hit_source": None}
    return {"prefix_hit_ratio": cached / prompt if prompt else None, "cached_tokens": cached,
            "prefix_hit_source": source}


def acceptance_length(counters_delta: dict[str, float] | None) -> float | None:
    """1 + accepted draft tokens / verify steps over the run; None without spec-decode counters or steps."""
    if not counters_delta or SPEC_ACCEPTED not in counters_delta or SPEC_STEPS not in counters_delta:
        return None
    steps = counters_delta[SPEC_STEPS]
    return 1.0 + counters_delta[SPEC_ACCEPTED] / steps if steps > 0 else None


def parse_counters(text: str, names: Iterable[str] = SCRAPED) -> dict[str, float]:
    """Sum over label sets of each named sample in a Prometheus text exposition (absent names are left out).

    A counter family `x` exposes its sample as `x_total`; either spelling in `names` matches it. A sample with a
    KEPT_LABELS label (`phase`, `generation`, a lane's SM count) is summed under `name:value` instead."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(names)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in (sample.name, sample.name + "_total"):
                if name in wanted:
                    kept = next((sample.labels[k] for k in KEPT_LABELS if k in sample.labels), None)
                    key = name if kept is None else f"{name}:{kept}"
                    sums[key] = sums.get(key, 0.0) + float(sample.value)
                    break
    return sums


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for names present after the run (a name new since `before` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
