"""Prometheus metrics of one worker (prefill or decode), served on the worker's own /metrics port.

Counters are bumped by the worker's gRPC handlers as requests finish and states move; gauges (running /
waiting requests, KV and state-slot usage, cached checkpoints) are read from the engine at scrape time on the
engine loop, so they never go stale. Each worker owns its registry: several workers can share a process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hybridserve.engine.spec_decode import SpecMetrics
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.gc_pauses import GENERATIONS, GcPauses

logger = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "abort", "error")

SCRAPE_TIMEOUT_S = 5.0


class _EngineGauges(Collector):
    """Load, pool usage and prefix-cache counters of the engine, sampled on its loop thread at scrape time."""

    def __init__(self, loop: EngineLoop, role: str) -> None:
        self._loop = loop
        self._role = role

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        def sample() -> tuple[dict[str, float], SpecMetrics | None, dict[str, Any] | None]:
            engine = self._loop.engine
            pool, stats, graphs = engine.pool, engine.stats(), engine.graph_stats()
            pages, slots = pool.pages, pool.slots
            radix = pool.radix
            return {
                "running": stats["num_running"],
                "waiting": stats["num_waiting"],
                "queued_prefill": stats["queued_prefill_tokens"],
                "kv": pages.num_used / pages.capacity if pages is not None and pages.capacity else 0.0,
                "slots": slots.num_used / slots.capacity if slots is not None and slots.capacity else 0.0,
                "checkpoints": radix.num_checkpoints if radix is not None else 0,
                "blocks": radix.num_nodes if radix is not None else 0,
                "queries": pool.num_queries,
                "hits": pool.num_hits,
                "hit_tokens": pool.num_hit_tokens,
                "graph_steps": graphs["graph_decode_steps"],
                "eager_decodes": graphs["eager_decode_steps"],
                "graph_prefills": graphs["graph_prefill_forwards"],
                "eager_prefills": graphs["eager_prefill_forwards"],
            }, dataclasses.replace(engine.spec.metrics, accepted_per_position=list(
                engine.spec.metrics.accepted_per_position)) if engine.spec is not None else None, \
                engine.multiplexer.stats() if engine.multiplexer is not None else None

        try:
            v, spec, multiplex = self._loop.call(sample, timeout=SCRAPE_TIMEOUT_S)
        except Exception as exc:  # a stopping loop: report nothing rather than fail the scrape
            logger.warning("worker metrics sample failed: %s", exc)
            return
        rows: list[tuple[str, str, float]] = [
            ("hybridserve_worker_running_requests", "Requests in the running batch", v["running"]),
            ("hybridserve_worker_waiting_requests", "Requests waiting for admission", v["waiting"]),
            ("hybridserve_worker_queued_prefill_tokens", "Prompt tokens of waiting requests", v["queued_prefill"]),
            ("hybridserve_worker_kv_cache_usage_ratio", "Fraction of KV pages in use", v["kv"]),
            ("hybridserve_worker_state_slot_usage_ratio", "Fraction of Mamba state slots in use", v["slots"]),
            ("hybridserve_worker_cached_checkpoints", "Mamba checkpoints in the prefix cache", v["checkpoints"]),
            ("hybridserve_worker_cached_blocks", "Token blocks in the prefix cache", v["blocks"]),
        ]
        yield from _role_families(GaugeMetricFamily, rows, self._role)
        counters: list[tuple[str, str, float]] = [
            ("hybridserve_worker_prefix_cache_queries",
             "Admissions that looked up the prefix cache (prompts over one cache block: shorter ones never hit)",
             v["queries"]),
            ("hybridserve_worker_prefix_cache_hits", "Admissions that found a checkpointed prefix", v["hits"]),
            ("hybridserve_worker_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", v["hit_tokens"]),
        ]
        loop_stats = self._loop.stats  # plain floats written by the loop thread: read without a trip to it
        counters = [
            ("hybridserve_worker_engine_steps", "Engine steps run", loop_stats.steps),
            ("hybridserve_worker_engine_step_seconds", "Time inside engine steps", loop_stats.step_seconds),
            ("hybridserve_worker_engine_gap_seconds",
             "Time between two back-to-back busy steps (output hand-off, posted calls, GIL waits)",
             loop_stats.gap_seconds),
            ("hybridserve_worker_engine_gaps", "Back-to-back busy steps (the gaps counted in engine_gap_seconds)",
             loop_stats.gaps),
            ("hybridserve_worker_engine_step_outputs", "Request outputs produced by engine steps", loop_stats.outputs),
            ("hybridserve_worker_engine_decode_only_steps", "Engine steps without prompt tokens",
             loop_stats.decode_only_steps),
            ("hybridserve_worker_engine_decode_only_step_seconds", "Time inside engine steps without prompt tokens",
             loop_stats.decode_only_seconds),
            ("hybridserve_worker_engine_decode_only_rows",
             "Decoding requests summed over the steps without prompt tokens (their mean batch = rows / steps)",
             loop_stats.decode_only_rows),
            ("hybridserve_worker_engine_graph_decode_steps", "Decode steps replayed from a CUDA graph", v["graph_steps"]),
            ("hybridserve_worker_engine_eager_decode_steps", "Decode-only steps that ran without a CUDA graph",
             v["eager_decodes"]),
            ("hybridserve_worker_engine_graph_prefill_forwards", "Prefill forwards replayed from a CUDA graph",
             v["graph_prefills"]),
            ("hybridserve_worker_engine_eager_prefill_forwards",
             "Prefill forwards that ran without a CUDA graph while prefill graphs were on", v["eager_prefills"]),
            *counters,
        ]
        yield from _role_families(CounterMetricFamily, counters, self._role)
        phases = CounterMetricFamily(
            "hybridserve_worker_engine_decode_only_phase_seconds",
            "Time of the steps without prompt tokens by phase: schedule, launch, while_running (overlapping the "
            "GPU), wait (for the sampled tokens), update", labels=["role", "phase"],
        )
        for phase, seconds in dict(loop_stats.decode_only_phase_seconds).items():
            phases.add_metric([self._role, phase], seconds)
        yield phases
        # without speculative decoding the families still exist, at 0 (dashboards show 0, not "No data")
        yield from _spec_families(spec if spec is not None else SpecMetrics(accepted_per_position=[0]), self._role)
        yield from _multiplex_families(multiplex or {}, self._role)


def _role_families(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily], rows: list[tuple[str, str, float]], role: str
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """One family per (name, doc, value) row, labelled with the worker's role."""
    for name, doc, value in rows:
        family = kind(name, doc, labels=["role"])
        family.add_metric([role], float(value))
        yield family


def _spec_families(spec: SpecMetrics, role: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding: acceptance length = 1 + accepted / verify_steps; per-position rates."""
    rows: list[tuple[str, str, float]] = [
        ("hybridserve_worker_spec_verify_steps", "Verify passes of a request that carried drafts", spec.num_drafts),
        ("hybridserve_worker_spec_draft_tokens", "Draft tokens proposed", spec.num_draft_tokens),
        ("hybridserve_worker_spec_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens),
    ]
    yield from _role_families(CounterMetricFamily, rows, role)
    family = CounterMetricFamily(
        "hybridserve_worker_spec_accepted_by_position", "Drafts accepted at each draft position (1-based)",
        labels=["role", "position"],
    )
    for position, count in enumerate(spec.accepted_per_position, start=1):
        family.add_metric([role, str(position)], float(count))
    yield family


def _multiplex_families(stats: dict[str, Any], role: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """pd_multiplex: the SM split in effect, its changes, and each lane's work by the SMs it ran on
    (engine/multiplex.py); 0 (no samples by SMs) on a co-located worker."""
    gauges: list[tuple[str, str, float]] = [
        ("hybridserve_worker_pd_multiplex_prefill_sms", "SMs of the prefill lane in the split in effect",
         stats.get("prefill_sms", 0)),
        ("hybridserve_worker_pd_multiplex_decode_sms", "SMs of the decode lane in the split in effect",
         stats.get("decode_sms", 0)),
    ]
    yield from _role_families(GaugeMetricFamily, gauges, role)
    counters: list[tuple[str, str, float]] = [
        ("hybridserve_worker_pd_multiplex_split_changes", "Times the SM split between the lanes changed",
         stats.get("split_changes", 0)),
        ("hybridserve_worker_pd_multiplex_handoffs", "Requests whose prompt passed from the prefill to the decode lane",
         stats.get("handoffs", 0)),
        ("hybridserve_worker_pd_multiplex_overlapped_decode_steps",
         "Decode steps that ran while a prefill forward was in flight", stats.get("overlapped_steps", 0)),
        ("hybridserve_worker_pd_multiplex_prefills_beside_decode",
         "Prefill forwards launched while a decode step ran (the one before taken as it completed)",
         stats.get("prefills_beside_decode", 0)),
        ("hybridserve_worker_pd_multiplex_whole_gpu_steps",
         "Steps run co-located on the whole GPU (one phase idle, or a deep backlog draining)",
         stats.get("whole_gpu_steps", 0)),
    ]
    yield from _role_families(CounterMetricFamily, counters, role)
    for name, doc, key, label in (
            ("hybridserve_worker_pd_multiplex_prefill_tokens",
             "Prompt tokens the prefill lane ran, by its SMs (whole-GPU steps: all of the device's; a prompt's one "
             "last token may run as a decode row)", "prefill_tokens_by_sms", "prefill_sms"),
            ("hybridserve_worker_pd_multiplex_decode_rows",
             "Rows the decode lane ran, by its SMs (whole-GPU steps: all of the device's)",
             "decode_rows_by_sms", "decode_sms")):
        family = CounterMetricFamily(name, doc, labels=["role", label])
        for sms, count in sorted(stats.get(key, {}).items()) or [(0, 0)]:  # co-located: one series at 0 SMs
            family.add_metric([role, str(sms)], float(count))
        yield family


class _GcPauseCounters(Collector):
    """The process's garbage-collector pauses and collections by generation."""

    def __init__(self, pauses: GcPauses, role: str) -> None:
        self._pauses = pauses
        self._role = role

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds = CounterMetricFamily("hybridserve_worker_gc_pause_seconds",
                                      "Time the worker process spent in garbage collections (GIL held), by generation",
                                      labels=["role", "generation"])
        count = CounterMetricFamily("hybridserve_worker_gc_collections", "Garbage collections, by generation",
                                    labels=["role", "generation"])
        for generation in GENERATIONS:
            seconds.add_metric([self._role, str(generation)], self._pauses.seconds.get(generation, 0.0))
            count.add_metric([self._role, str(generation)], self._pauses.collections.get(generation, 0))
        yield seconds
        yield count


class WorkerMetrics:
    """The registry of one worker and the counters its handlers bump."""

    def __init__(self, loop: EngineLoop, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(loop, role))
        self.gc_pauses = GcPauses()
        self.registry.register(_GcPauseCounters(self.gc_pauses, role))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["role", *labels], registry=self.registry)

        self.requests = counter("hybridserve_worker_requests", "Finished requests by finish reason", ("finish_reason",))
        self.prompt_tokens = counter("hybridserve_worker_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("hybridserve_worker_generation_tokens", "Tokens generated")
        self.transfer_bytes = counter("hybridserve_worker_transfer_bytes", "State bytes moved prefill -> decode")
        self.transfer_seconds = counter("hybridserve_worker_transfer_seconds", "Time spent moving state")
        self.transfer_failures = counter("hybridserve_worker_transfer_failures", "State transfers that failed")
        for family in (self.prompt_tokens, self.generation_tokens, self.transfer_bytes, self.transfer_seconds,
                       self.transfer_failures):
            family.labels(role)  # at 0 from the start: dashboards show 0 rather than "No data"
        for reason in FINISH_REASONS:
            self.requests.labels(role, reason)
        self._server: Any = None  # prometheus_client's WSGI server once started
        self.port = 0

    def observe_finished(self, prompt_tokens: int, generated: int, finish_reason: str) -> None:
        r = self.role
        self.requests.labels(r, finish_reason or "unknown").inc()
        self.prompt_tokens.labels(r).inc(prompt_tokens)
        self.generation_tokens.labels(r).inc(generated)

    def observe_transfer(self, num_bytes: int, seconds: float, ok: bool) -> None:
        if ok:
            self.transfer_bytes.labels(self.role).inc(num_bytes)
            self.transfer_seconds.labels(self.role).inc(seconds)
        else:
            self.transfer_failures.labels(self.role).inc()

    def start(self, host: str, port: int = 0) -> int:
        """Serve /metrics over HTTP; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def stop(self) -> None:
        self.gc_pauses.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
