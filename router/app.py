"""The router as one object: orchestrator, admission, metrics, and the HTTP and gRPC front doors.

`hybridserve serve`, the tests and the benchmark build it the same way; `targets()` is the Prometheus
http_sd list of every component's /metrics (the router's HTTP port and each worker's metrics port).
"""

from __future__ import annotations

import logging

from hybridserve.common.generation_defaults import load_generation_defaults
from hybridserve.common.model_config import DEFAULT_MAX_MODEL_LEN, ModelConfig
from hybridserve.common.tokenizer import load_tokenizer
from hybridserve.router.admission import AdmissionController
from hybridserve.router.chat_template import ChatTemplate
from hybridserve.router.config import RouterOptions
from hybridserve.router.connection_guard import ConnectionLimits
from hybridserve.router.frontend import Frontend
from hybridserve.router.grpc_server import start_router_server
from hybridserve.router.http_server import HttpServer, create_app
from hybridserve.router.metrics import RouterMetrics
from hybridserve.router.orchestrator import Orchestrator
from hybridserve.router.path_warmup import WARMUP_SETTLE_S, warm_serving_path

logger = logging.getLogger(__name__)

__all__ = ["Router", "RouterOptions"]


class Router:
    def __init__(self, options: RouterOptions, prefill_addresses: list[str], decode_addresses: list[str]) -> None:
        self.options = options
        model_config = ModelConfig.from_dir(options.model_dir)
        self.metrics = RouterMetrics()
        self.orchestrator = Orchestrator(prefill_addresses, decode_addresses, options.orchestrator, self.metrics,
                                         internal_token=options.internal_token,
                                         internal_tls=options.internal_tls)
        tokenizer = load_tokenizer(options.model_dir)
        # the running limit follows what the decode workers report they hold (unless max_running fixes it)
        workers = self.orchestrator.workers
        admission = AdmissionController(options.admission, self.metrics, capacity=workers.capacity)
        workers.on_health.append(admission.refresh)
        max_len = options.max_model_len or model_config.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        self.frontend = Frontend(
            self.orchestrator, options.served_name, tokenizer,
            ChatTemplate.from_model_dir(options.model_dir) if tokenizer is not None else None,
            model_config.vocab_size, max_len, admission, self.metrics,
            load_generation_defaults(options.generation_config, options.model_dir).as_dict(),
        )
        self.http: HttpServer | None = None
        self.grpc_server = None
        self.http_address: str | None = None
        self.grpc_address: str | None = None

    def start(self) -> Router:
        """Open the doors, warm the serving path through them (`warm_up_path`), then report ready on /ready."""
        o = self.options
        keys = o.api_keys
        loop = self.orchestrator.loop  # both doors run on the orchestrator's loop: a request never crosses threads
        self.frontend.path_warm = not o.warm_up_path
        if o.http_port is not None:
            self.http = HttpServer(create_app(self.frontend, self.targets, keys, o.max_body_bytes), o.host,
                                   o.http_port, loop, ConnectionLimits.of(o))
            self.http_address = self.http.start()
        if o.grpc_port is not None:
            self.grpc_server, self.grpc_address = loop.run(start_router_server(
                self.frontend, o.host, o.grpc_port, api_keys=keys, handshake_timeout_s=o.header_timeout_s,
                limits=ConnectionLimits.of(o)))
        if o.warm_up_path:
            self.orchestrator.workers.poll_once()  # the workers' Health first: the warm-up then takes their sessions
            warm_serving_path(self.http_address, self.grpc_address, o.served_name, keys.keys[0][1] if keys else None)
            if not self.frontend.admission.wait_idle(WARMUP_SETTLE_S):  # their bookkeeping after the last byte
                logger.warning("requests still in flight %.0f s after the path warm-up: the metrics restart under them",
                               WARMUP_SETTLE_S)
            self.metrics.restart()  # the warm-up requests are not traffic: every series starts at 0
            self.frontend.path_warm = True
        return self

    def update_workers(self, prefill_addresses: list[str], decode_addresses: list[str]) -> None:
        self.orchestrator.update_workers(prefill_addresses, decode_addresses)

    def targets(self) -> list[dict]:
        """Prometheus http_sd target groups: the router, then every worker that reports a metrics port."""
        groups = []
        if self.http_address:
            groups.append({"targets": [self.http_address], "labels": {"component": "router"}})
        for handle in self.orchestrator.workers.all():
            if handle.health is not None and handle.health.metrics_port:
                groups.append({"targets": [f"{handle.host}:{handle.health.metrics_port}"],
                               "labels": {"component": f"{handle.role}_worker", "worker": handle.address}})
        return groups

    def endpoints(self) -> list[str]:
        lines = []
        if self.http_address:
            base = f"http://{self.http_address}"
            lines += [f"OpenAI API   {base}/v1 (completions, chat/completions, models)",
                      f"health       {base}/health  {base}/ready",
                      f"metrics      {base}/metrics  (Prometheus http_sd of all components: {base}/targets)"]
        if self.grpc_address:
            lines.append(f"gRPC         grpc://{self.grpc_address} "
                         "(hybridserve.v1.Router/Generate, Abort, Health; reflection on)")
        return lines

    def drain(self, timeout_s: float | None = None) -> bool:
        """SIGTERM: readiness goes false and new requests get 503 / UNAVAILABLE; the requests in flight get
        `timeout_s` (default: the options') to finish, then are aborted (their clients see an error).
        Returns whether all finished. Call stop() after."""
        timeout = self.options.drain_timeout_s if timeout_s is None else timeout_s
        logger.info("draining: %d requests in flight, up to %.0f s", self.frontend.admission.running, timeout)
        if self.frontend.admission.drain(timeout):
            return True
        logger.warning("drain timeout: aborting %d requests", self.orchestrator.abort_all())
        self.frontend.admission.drain(5.0)  # the aborted streams send their error and release their slots
        return False

    def stop(self) -> None:
        if self.grpc_server is not None:
            self.orchestrator.loop.run(self.grpc_server.stop(1))
        if self.http is not None:
            self.http.stop()
        self.orchestrator.close()
