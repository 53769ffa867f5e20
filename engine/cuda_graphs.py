"""CUDA graphs for the decode step: the forward of one new token per sequence (or, speculating, of the T = K + 1
verify tokens per sequence with the engine's rollback), captured once per batch-size bucket and replayed, so a
decode or verify step costs one graph launch instead of hundreds of kernel launches.

Inputs are copied into static buffers; rows past the real batch are padding (state slot -1 and KV slot -1,
which every kernel skips; kv_len T on page 0, whose output is discarded). Only decode-only batches whose
size fits a bucket, whose rows have the captured token count and rollback, and whose block tables fit the
captured width take the graph; the rest run eagerly. A verify graph's per-token SSM states ("intermediate"
rollback) live in the graph's pool: they are handed to the step's batch and read before the next forward.
A mixed step (decode or verify rows beside prefill chunks) replays the decode rows' graph and hands the prefill
chunks to the prefill graphs (engine/prefill_graphs.py) or, where none takes them, runs them eagerly: a prefill step
is bound by the host's kernel launches (~40 ms for the 9B at any chunk size on the H200,
bench/results/h200/serving/), and the decode rows' eager path added to them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache

logger = logging.getLogger(__name__)

# powers of two up to 8: a padded row costs ~nothing (a batch of 5 or 6 on the 8-row graph: +0.6 / +1.8 % of a
# 9B step, bench/results/h200/serving/), so per-size buckets were not kept; steps of 64 rows up to 512 and
# 128 up to 1,024 keep a large batch's padding under 25 % (production concurrency runs hundreds of rows)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


class DecodeGraphs:
    """Captured decode forwards of `model` over `cache`, one graph per bucket up to `max_batch`; `tokens` > 1: verify
    forwards of that many tokens per row with `rollback` ("intermediate" or "replay", as the engine speculates).
    `ModelRunner.forward` decides which batches replay them."""

    def __init__(
        self, model: HybridLM, cache: StateCache, max_batch: int, max_pages_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS, tokens: int = 1, rollback: str | None = None,
    ) -> None:
        if max_batch <= 0 or max_pages_per_seq <= 0:
            raise ValueError(f"max_batch ({max_batch}) and max_pages_per_seq ({max_pages_per_seq}) must be positive")
        if tokens < 1 or (rollback is None) != (tokens == 1):
            raise ValueError(f"decode graphs take 1 token per row and no rollback, verify graphs more tokens and a "
                             f"rollback; got tokens={tokens}, rollback={rollback!r}")
        self.model = model
        self.cache = cache
        self.tokens = tokens
        self.rollback = rollback
        self.buckets = tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))
        device = next(model.parameters()).device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n * tokens, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int64, device=device) * tokens
        self.context_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.kv_lens = torch.full((n,), tokens, dtype=torch.int64, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_pages_per_seq, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n * tokens,), -1, dtype=torch.int64, device=device)
        self.num_replay = torch.zeros(n, dtype=torch.int32, device=device) if rollback == "replay" else None
        # bucket -> (graph, hidden [size * tokens, hidden], per-token SSM states of the "intermediate" rollback)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[int, torch.Tensor]]] = {}
        self.pool: Any = None

    def _batch(self, size: int) -> ForwardBatch:
        rows = size * self.tokens
        return ForwardBatch(
            num_decode=size,
            query_lens=(self.tokens,) * size,
            cu_seqlens=self.cu_seqlens[: size + 1],
            context_lens=self.context_lens[:size],
            kv_lens=self.kv_lens[:size],
            state_slots=self.state_slots[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:rows],
            decode_len=self.tokens,
            spec_rollback=self.rollback,
            num_replay=None if self.num_replay is None else self.num_replay[:size],
        )

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream | None = None) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool; on `stream` when given (an
        SM partition's: the graphs' kernels then run on its SMs), else on side streams."""
        lane = stream
        stream = lane if lane is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):  # warm-up: compiles / autotunes every kernel eagerly
                self.model(self.input_ids[: size * self.tokens], self._batch(size), self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            batch = self._batch(size)
            with torch.cuda.graph(graph, pool=self.pool, stream=lane):
                hidden = self.model(self.input_ids[: size * self.tokens], batch, self.cache)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, hidden, batch.intermediate_states)

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket that replays this batch, or None when it must run eagerly."""
        if not self.graphs or batch.num_decode != batch.num_seqs or batch.boundary_rows is not None:
            return None
        if batch.decode_len != self.tokens or batch.spec_rollback != self.rollback:
            return None
        if batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next((b for b in self.buckets if b >= batch.num_seqs), None)

    @torch.inference_mode()
    def replay(self, size: int, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_seqs * tokens, hidden] of a decode-only batch by replaying bucket `size` (from
        `bucket_for`); a verify step's per-token SSM states go into `batch.intermediate_states` (views of the
        graph's buffers, valid until the next replay)."""
        n, pages, t = batch.num_seqs, batch.block_tables.shape[1], self.tokens
        self.input_ids[: n * t].copy_(input_ids)
        self.context_lens[:n].copy_(batch.context_lens)
        self.kv_lens[:n].copy_(batch.kv_lens)
        self.kv_lens[n:size].fill_(t)
        self.state_slots[:n].copy_(batch.state_slots)
        self.state_slots[n:size].fill_(-1)
        self.slot_mapping[: n * t].copy_(batch.slot_mapping)
        self.slot_mapping[n * t : size * t].fill_(-1)
        self.block_tables[:n, :pages].copy_(batch.block_tables)
        if self.num_replay is not None:
            if batch.num_replay is None:
                raise ValueError("a replay verify batch needs num_replay")
            self.num_replay[:n].copy_(batch.num_replay)
            self.num_replay[n:size].fill_(0)
        graph, hidden, states = self.graphs[size]
        graph.replay()
        batch.intermediate_states.update({layer: s[:n] for layer, s in states.items()})
        return hidden[: n * t]


def capture_decode_graphs(
    model: HybridLM, cache: StateCache, max_batch: int, max_pages_per_seq: int, tokens: int = 1,
    rollback: str | None = None,
) -> DecodeGraphs | None:
    """Decode graphs (`tokens` > 1: verify graphs with `rollback`) of `model` over `cache` on CUDA, or None: a model
    whose step cannot be captured (a layer that syncs with the host) keeps running eagerly."""
    graphs = DecodeGraphs(model, cache, max_batch, max_pages_per_seq, tokens=tokens, rollback=rollback)
    try:
        graphs.capture()
    except RuntimeError as exc:
        logger.warning("%s step not capturable as a CUDA graph, running eagerly: %s",
                       "verify" if tokens > 1 else "decode", exc)
        torch.cuda.synchronize()
        return None
    return graphs
