"""Prometheus metrics of the router (prefix `hybridserve_router_`, base units, bounded label values).

Labels only take values from fixed sets (endpoint, status class, error kind, routing reason, retry stage)
or the worker list (a handful of addresses), so cardinality never grows with traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

ERROR_KINDS = ("invalid_request", "unauthorized", "not_found", "overloaded", "unavailable", "timeout", "cancelled", "conflict",
               "too_large", "internal")
# the label values each labelled family is created with at 0, so a dashboard shows a flat 0 on a healthy system
# instead of "No data" until the first event (tests/router/test_metrics_zeros.py keeps them in step with the code)
GENERATE_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "grpc/Generate")
ROUTES = (("local", "no_prefill_worker"), ("local", "decode_prefix_hit"), ("local", "short_tail"), ("local", "needs_local"),
          ("disaggregated", "prefill_cached_prefix"), ("disaggregated", "prefill_least_cost"))
RETRY_STAGES = ("generate_local", "reserve", "prefill", "stream")


class RouterMetrics:
    """Every router metric in its own registry (several routers can live in one process, e.g. in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._scrape_functions: dict[str, Callable[[], float]] = {}  # gauge attribute -> its scrape-time function
        self._build(registry or CollectorRegistry())

    def restart(self) -> None:
        """Every series back to its start value, in a fresh registry: the router's own warm-up requests
        (router/path_warmup.py) are not traffic. Holders of this object see the new series; call it while no
        request is in flight."""
        fresh = RouterMetrics.__new__(RouterMetrics)
        fresh._scrape_functions = self._scrape_functions
        fresh._build(CollectorRegistry())
        self.__dict__ = fresh.__dict__  # one assignment: a scrape or a request sees the old series or the new

    def scrape_function(self, gauge: str, function: Callable[[], float]) -> None:
        """Gauge attribute `gauge` reads `function()` at scrape time (kept across `restart`)."""
        self._scrape_functions[gauge] = function
        getattr(self, gauge).set_function(function)

    def _build(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = self.registry
        self.requests = Counter("hybridserve_router_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("hybridserve_router_errors", "Failed requests by kind", ["kind"], registry=r)
        self.ttft = Histogram("hybridserve_router_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("hybridserve_router_inter_token_seconds", "Gap between streamed token events",
                                     buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("hybridserve_router_request_duration_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("hybridserve_router_admission_wait_seconds", "Time waiting for admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.routing = Counter("hybridserve_router_routing_decisions", "Routing decisions by mode and reason",
                               ["mode", "reason"], registry=r)
        self.retries = Counter("hybridserve_router_retries", "Retries before the first token, by stage",
                               ["stage"], registry=r)
        self.prompt_tokens = Counter("hybridserve_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.generation_tokens = Counter("hybridserve_router_generation_tokens", "Tokens streamed back", registry=r)
        self.index_predicted = Counter("hybridserve_router_prefix_index_hit_tokens",
                                       "Prompt tokens the index predicted cached (checkpointed) on the chosen worker",
                                       registry=r)
        self.worker_cached = Counter("hybridserve_router_worker_cached_tokens",
                                     "Prompt tokens the workers reported served from their prefix cache", registry=r)
        self.index_resyncs = Counter("hybridserve_router_prefix_index_resyncs", "Snapshots taken after lost events",
                                     registry=r)
        self.index_nodes = Gauge("hybridserve_router_prefix_index_nodes", "Blocks in the global prefix index",
                                 registry=r)
        self.running = Gauge("hybridserve_router_running_requests", "Admitted requests in flight", registry=r)
        self.queued = Gauge("hybridserve_router_queued_requests", "Requests waiting for admission", registry=r)
        self.seat_waiters = Gauge("hybridserve_router_decode_seat_waiters",
                                  "Requests waiting for a free state slot on their (full) decode worker", registry=r)
        self.seat_waits = Counter("hybridserve_router_decode_seat_waits",
                                  "Waits for a free state slot on a full decode worker", registry=r)
        self.breaker = Gauge("hybridserve_router_worker_circuit_state",
                             "Circuit breaker per worker: 0 closed, 1 half-open, 2 open", ["role", "worker"],
                             registry=r)
        self.index_hit_ratio = Gauge("hybridserve_router_prefix_index_hit_ratio",
                                     "Predicted cached prompt tokens / prompt tokens, since start", registry=r)
        for endpoint in GENERATE_ENDPOINTS:
            self.requests.labels(endpoint, "200")
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for mode, reason in ROUTES:
            self.routing.labels(mode, reason)
        for stage in RETRY_STAGES:
            self.retries.labels(stage)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()
        self._prompt_total = 0
        self._predicted_total = 0
        self.index_hit_ratio.set_function(self._hit_ratio)  # computed at scrape time, not per request
        for gauge, function in self._scrape_functions.items():
            getattr(self, gauge).set_function(function)

    def child(self, family: Counter | Gauge | Histogram, *values: str) -> Any:
        """`family.labels(*values)`, looked up once: `labels()` builds and checks its key under a lock on every
        call, ~10x a plain dict hit, and the request path counts several labelled metrics per request."""
        key = (id(family), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*values)
        return found

    def count_request(self, endpoint: str, status: str) -> None:
        self.child(self.requests, endpoint, status).inc()

    def count_error(self, kind: str) -> None:
        self.child(self.errors, kind).inc()

    def observe_hit(self, prompt_tokens: int, predicted: int) -> None:
        """A routed prompt and the index's checkpointed hit on the worker chosen to prefill it."""
        self.prompt_tokens.inc(prompt_tokens)
        self.index_predicted.inc(predicted)
        with self._lock:
            self._prompt_total += prompt_tokens
            self._predicted_total += predicted

    def _hit_ratio(self) -> float:
        with self._lock:
            return self._predicted_total / self._prompt_total if self._prompt_total else 0.0
