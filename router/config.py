"""Tunables of the router: routing policy, resilience, admission. Frozen and validated on construction.

Defaults are chosen for a small deployment (a handful of workers per role); each field says what it trades.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.common.generation_defaults import load_generation_defaults
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.router.auth import ApiKeys

MAX_BODY_BYTES = 8 << 20  # a 128K-token prompt as JSON token ids is ~1 MB


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class RoutingConfig:
    """How requests are placed on workers (see `router/policy.py`)."""

    # Conditional disaggregation: the decode worker prefills locally when the tail it would have to compute
    # (prompt minus its own checkpointed hit) is at most this many tokens; a remote prefill then costs more
    # (reservation, transfer) than the compute it saves.
    local_prefill_max_tokens: int = 0
    # ... or when its own checkpointed hit covers at least this fraction of the prompt (multi-turn chat: the
    # previous turn's state is on the decode worker). 0 disables the rule.
    local_prefill_min_hit_fraction: float = 0.5
    # Prefill cost = uncached_tokens * (1 + queued_prefill_tokens / prefill_queue_scale_tokens)
    #               + prefill_load_weight * (running + waiting requests).
    prefill_queue_scale_tokens: int = 2048
    prefill_load_weight: float = 16.0
    # Decode cost = decode_load_weight * (running + waiting) / slots - decode_hit_weight * hit fraction;
    # a worker with no free state slot gets decode_full_penalty added.
    decode_load_weight: float = 1.0
    decode_hit_weight: float = 0.5
    decode_full_penalty: float = 10.0

    def __post_init__(self) -> None:
        _check(self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens must be >= 0")
        _check(0.0 <= self.local_prefill_min_hit_fraction <= 1.0, "local_prefill_min_hit_fraction must be in [0, 1]")
        _check(self.prefill_queue_scale_tokens > 0, "prefill_queue_scale_tokens must be > 0")
        for name in ("prefill_load_weight", "decode_load_weight", "decode_hit_weight", "decode_full_penalty"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0")


@dataclass(frozen=True)
class ResilienceConfig:
    """Deadlines, retries and circuit breaking of the router's calls to workers."""

    reserve_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    stream_timeout_s: float = 3600.0  # whole token stream of one request
    control_timeout_s: float = 5.0  # Abort, Health
    reservation_ttl_s: float = 120.0
    # decode workers all full (no slot / pages): wait in the worker's seat queue this long, then 429; None: as
    # long as the client waits (admission already bounds how many requests the router holds)
    capacity_wait_s: float | None = None
    attempts: int = 3  # tries of a request that fails with UNAVAILABLE before its first token
    backoff_base_s: float = 0.05  # retry k waits uniform(0, min(cap, base * 2**k)) ("full jitter")
    backoff_cap_s: float = 1.0
    breaker_failures: int = 3  # consecutive failures that open a worker's breaker
    breaker_reset_s: float = 5.0  # an open breaker lets one probe through after this long
    health_interval_s: float = 0.5  # load / geometry poll of every worker
    # a worker whose health call has gone unanswered this long (frozen, swapped out, its host gone quiet) is
    # unresponsive: no new requests, and /ready counts it out (a live worker answers within ~1 s, mid-step too)
    unresponsive_after_s: float = 5.0
    # a client that stops reading its stream: at most this many token events wait in the router for it, and when
    # they stay full this long the request is aborted on its workers and the stream ends with an error
    stream_buffer_events: int = 256
    stream_stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("reserve_timeout_s", "prefill_timeout_s", "stream_timeout_s", "control_timeout_s",
                     "reservation_ttl_s", "backoff_cap_s", "breaker_reset_s", "health_interval_s",
                     "stream_stall_timeout_s", "unresponsive_after_s"):
            _check(getattr(self, name) > 0, f"{name} must be > 0")
        _check(self.capacity_wait_s is None or self.capacity_wait_s > 0, "capacity_wait_s must be > 0 or None")
        _check(self.backoff_base_s >= 0, "backoff_base_s must be >= 0")
        _check(self.attempts >= 1, "attempts must be >= 1")
        _check(self.stream_buffer_events >= 1, "stream_buffer_events must be >= 1")
        _check(self.breaker_failures >= 1, "breaker_failures must be >= 1")


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission that queues: as many requests run as the decode workers report they hold (or max_running);
    up to max_queued more wait in arrival order, as long as their client does (or queue_timeout_s)."""

    max_running: int | None = None  # None: what the decode workers report (Health max_running, max_num_waiting)
    max_queued: int = 65536  # requests waiting beyond the running ones; more get 429 with Retry-After
    queue_timeout_s: float | None = None  # None: no deadline of the router's own (the client's applies)
    # requests one client (its API key, or its address without one) may have running or queued at once; more
    # get 429. 0: no per-client limit (clients behind one proxy share an address)
    max_per_client: int = 0

    def __post_init__(self) -> None:
        _check(self.max_per_client >= 0, "max_per_client must be >= 0")
        _check(self.max_running is None or self.max_running >= 1, "max_running must be >= 1 or None")
        _check(self.max_queued >= 0, "max_queued must be >= 0")
        _check(self.queue_timeout_s is None or self.queue_timeout_s > 0, "queue_timeout_s must be > 0 or None")


@dataclass(frozen=True)
class OrchestratorConfig:
    """Everything the orchestrator needs; `local_prefill_max_tokens` is a shortcut kept for callers that set
    only that (it overrides routing.local_prefill_max_tokens when given)."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    local_prefill_max_tokens: int | None = None
    # local requests go on one Session stream per decode worker that offers it (router/worker_session.py);
    # False: a GenerateLocal call each (the path before sessions; a switch for comparing and for operators)
    worker_sessions: bool = True
    # a session goes over the worker's socket session when it offers one (router/session_socket.py: no gRPC
    # machinery per message); False: always the gRPC Session stream
    worker_socket_sessions: bool = True

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens is not None:
            _check(self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens must be >= 0")
            object.__setattr__(
                self, "routing",
                RoutingConfig(**{**self.routing.__dict__, "local_prefill_max_tokens": self.local_prefill_max_tokens}),
            )


@dataclass(frozen=True)
class RouterOptions:
    """Where the router listens and how it behaves; port 0 picks a free port, None disables that door."""

    model_dir: str
    model_name: str | None = None  # served model id; default: the checkpoint directory's name
    host: str = "127.0.0.1"
    http_port: int | None = 8000
    grpc_port: int | None = 50051
    max_model_len: int | None = None  # default: the engine's limit (config) or the model's
    # sampling defaults for what a request leaves unset: "auto" (the checkpoint's generation_config.json),
    # "none", or a folder with a generation_config.json (vLLM's --generation-config)
    generation_config: str = "auto"
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # required of clients on /v1 (HTTP) and every gRPC call when set: a key, or several ("KEY" or "NAME=KEY");
    # a client's identity (aborts, request ids, max_per_client) is its key's name
    api_key: str | tuple[str, ...] | None = None
    api_key_file: str | None = None  # more keys, one "KEY" or "NAME=KEY" a line (# comments)
    # HTTP connections: closed when no byte arrives within first_byte_timeout_s of opening, or a request's headers
    # are not complete within header_timeout_s of its first byte (slow-header attacks); at most
    # max_connections open, max_connections_per_peer from one address (more are closed at once). gRPC: the
    # handshake within header_timeout_s, at most max_connections open, max_connections_per_peer busy from one
    # address (a call on one more is refused, RESOURCE_EXHAUSTED)
    first_byte_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    max_connections: int = 16384
    max_connections_per_peer: int = 4096
    max_body_bytes: int = MAX_BODY_BYTES  # larger HTTP request bodies get 413
    # shared secret the router sends on every call to a worker (WorkerOptions.internal_token); None: insecure
    internal_token: str | None = None
    # SIGTERM: seconds the requests in flight get to finish (new ones get 503) before they are aborted
    drain_timeout_s: float = 30.0
    # mutual TLS on the router's channels to workers (WorkerOptions.internal_tls); empty: plaintext
    internal_tls: InternalTlsConfig = field(default_factory=InternalTlsConfig)
    # before /ready reports ready: one one-token request through each door, end to end, so the first user
    # request does not pay for the path's first-time work (router/path_warmup.py)
    warm_up_path: bool = True

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535] or None, got {port}")
        if self.http_port is None and self.grpc_port is None:
            raise ValueError("the router needs at least one of http_port and grpc_port")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError("max_model_len must be > 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        load_generation_defaults(self.generation_config, self.model_dir)  # a bad setting fails at start-up
        self.api_keys  # noqa: B018 - a bad key or key file fails at start-up
        for name in ("first_byte_timeout_s", "header_timeout_s", "max_connections", "max_connections_per_peer"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def api_keys(self) -> ApiKeys:
        return ApiKeys.load(self.api_key, self.api_key_file)

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model_dir).name
