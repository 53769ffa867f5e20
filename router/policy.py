"""Where a request runs: the decode worker, and a prefill worker or none (conditional disaggregation).

Inputs are the prompt's chained block hashes looked up in the global prefix index (only checkpointed depth
counts: a Mamba state cannot be rebuilt from KV) and each worker's last health snapshot.

- Decode: cost = decode_load_weight * (running + waiting) / slots - decode_hit_weight * (own hit / prompt)
  + decode_full_penalty when it has no free state slot. The hit term keeps a conversation on the worker that
  holds its previous turn.
- Local prefill on that decode worker when there is no usable prefill worker ("no_prefill_worker"), when its
  own checkpointed hit covers at least local_prefill_min_hit_fraction of the prompt ("decode_prefix_hit"),
  or when the tail it would compute is at most local_prefill_max_tokens ("short_tail").
- Otherwise prefill on the worker minimising uncached_tokens * (1 + queued_prefill_tokens / scale)
  + prefill_load_weight * (running + waiting): "prefill_cached_prefix" when that worker has a hit,
  "prefill_least_cost" when none does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from hybridserve.common.block_hash import block_hashes
from hybridserve.router.config import RoutingConfig
from hybridserve.router.prefix_index import PrefixIndex, WorkerHit
from hybridserve.router.workers import WorkerHandle

logger = logging.getLogger(__name__)

REASONS = ("no_prefill_worker", "decode_prefix_hit", "short_tail", "needs_local", "prefill_cached_prefix",
           "prefill_least_cost")  # needs_local: the orchestrator's override for requests with logprobs


class NoWorkerError(RuntimeError):
    """No decode worker can take the request (all excluded or their breakers are open)."""


@dataclass(frozen=True)
class Decision:
    decode: WorkerHandle
    prefill: WorkerHandle | None  # None: the decode worker prefills locally
    reason: str
    predicted_cached_tokens: int  # the index's checkpointed hit on the worker that prefills

    @property
    def local(self) -> bool:
        return self.prefill is None


def prompt_hashes(prompt: Sequence[int], block_size: int | None) -> list[str]:
    """Hex hashes of the prompt's full blocks, excluding a block that ends on the last token (the engine
    always computes at least one token, so such a block can never be a hit)."""
    if not block_size or len(prompt) < 2:
        return []
    return [h.hex() for h in block_hashes(list(prompt[: len(prompt) - 1]), block_size)]


class RoutingPolicy:
    def __init__(self, config: RoutingConfig, index: PrefixIndex) -> None:
        self.config = config
        self.index = index
        self._turn = itertools.count()

    def decide(self, prompt: Sequence[int], prefill: list[WorkerHandle], decode: list[WorkerHandle],
               block_size: int | None, exclude: Collection[WorkerHandle] = ()) -> Decision:
        hits = self.index.match(prompt_hashes(prompt, block_size)) if block_size else {}
        n = max(len(prompt), 1)
        decode_ok = self._usable(decode, exclude)
        if not decode_ok:
            raise NoWorkerError("no decode worker is available (all failed or their circuit breakers are open)")
        d = self._take(decode_ok, lambda h: self._decode_cost(h, hits.get(h.key), n))
        if d is None:
            raise NoWorkerError("no decode worker is available (all failed or their circuit breakers are open)")
        d_hit = _hit(hits.get(d.key))
        prefill_ok = self._usable(prefill, exclude)
        cfg = self.config
        if not prefill_ok:
            return self._log(Decision(d, None, "no_prefill_worker", d_hit), prompt)
        if cfg.local_prefill_min_hit_fraction > 0 and d_hit > 0 and d_hit >= cfg.local_prefill_min_hit_fraction * n:
            return self._log(Decision(d, None, "decode_prefix_hit", d_hit), prompt)
        if len(prompt) - d_hit <= cfg.local_prefill_max_tokens:
            return self._log(Decision(d, None, "short_tail", d_hit), prompt)
        p = self._take(prefill_ok, lambda h: self._prefill_cost(h, _hit(hits.get(h.key)), len(prompt)))
        if p is None:
            return self._log(Decision(d, None, "no_prefill_worker", d_hit), prompt)
        p_hit = _hit(hits.get(p.key))
        reason = "prefill_cached_prefix" if p_hit > 0 else "prefill_least_cost"
        return self._log(Decision(d, p, reason, p_hit), prompt)

    # ---- costs -----------------------------------------------------------------------------------
    def _decode_cost(self, h: WorkerHandle, hit: WorkerHit | None, n: int) -> float:
        cfg, health = self.config, h.health
        cost = -cfg.decode_hit_weight * _hit(hit) / n
        if health is not None:
            slots = max(int(health.total_state_slots), 1)
            cost += cfg.decode_load_weight * (health.num_running + health.num_waiting) / slots
            if health.total_state_slots and health.free_state_slots == 0:
                cost += cfg.decode_full_penalty
        return cost

    def _prefill_cost(self, h: WorkerHandle, hit: int, n: int) -> float:
        cfg, health = self.config, h.health
        queued = health.queued_prefill_tokens if health is not None else 0
        load = (health.num_running + health.num_waiting) if health is not None else 0
        return (n - hit) * (1.0 + queued / cfg.prefill_queue_scale_tokens) + cfg.prefill_load_weight * load

    # ---- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _usable(handles: list[WorkerHandle], exclude: Collection[WorkerHandle]) -> list[WorkerHandle]:
        return [h for h in handles if h not in exclude and not h.draining and not h.unresponsive and h.breaker.available()]

    def _take(self, handles: list[WorkerHandle], cost) -> WorkerHandle | None:
        """The cheapest worker whose breaker lets this request through: a half-open breaker admits one probe,
        so a second request at the same time moves on to the next worker."""
        candidates = list(handles)
        while candidates:
            chosen = self._cheapest(candidates, cost)
            if chosen.breaker.acquire():
                return chosen
            candidates.remove(chosen)
        return None

    def _cheapest(self, handles: list[WorkerHandle], cost) -> WorkerHandle:
        """Lowest cost; ties go round robin (the list is rotated by a counter before the stable min)."""
        shift = next(self._turn) % len(handles)
        rotated = handles[shift:] + handles[:shift]
        return min(rotated, key=cost)

    @staticmethod
    def _log(decision: Decision, prompt: Sequence[int]) -> Decision:
        """One DEBUG line per decision: at INFO it was a formatted, flushed write on every request's path
        (the decisions are counted in metrics and kept in `Orchestrator.recent_decisions` anyway)."""
        if not logger.isEnabledFor(logging.DEBUG):
            return decision
        logger.debug(
            "route: %s prompt_tokens=%d decode=%s prefill=%s predicted_cached=%d",
            decision.reason, len(prompt), decision.decode.address,
            decision.prefill.address if decision.prefill else "local", decision.predicted_cached_tokens,
        )
        return decision


def _hit(hit: WorkerHit | None) -> int:
    return hit.checkpoint_tokens if hit is not None else 0
