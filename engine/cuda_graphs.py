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

import dataclasses
import logging
from typing import Any, Protocol

import torch

from hybridserve.env_switch import env_switch
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache

logger = logging.getLogger(__name__)

# powers of two up to 8: a padded row costs ~nothing (a batch of 5 or 6 on the 8-row graph: +0.6 / +1.8 % of a
# 9B step, bench/results/h200/serving/), so per-size buckets were not kept; steps of 64 rows up to 512 and
# 128 up to 1,024 keep a large batch's padding under 25 % (production concurrency runs hundreds of rows)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def stage_cuts(num_layers: int) -> tuple[int, ...]:
    """The layers after which a captured step starts a new graph: 0, 3, 15, 63, ... (pieces of 1, 3, 12, 48 layers).

    The GPU starts a graph only once its whole cudaGraphLaunch call has returned (~0.85 us of host time per kernel
    node, ~255 us for the 9B's ~300-node step, all of it GPU idle time per step: bench/results/h200/serving/).
    In pieces, the GPU runs the first (1 layer, a few nodes) while the host launches the next, and each piece's GPU
    time (~50-100 us a layer) covers the launch of the next, 4x longer (~4 us a layer): only the first piece's launch
    stays exposed."""
    cuts, end = [], 1
    while end < num_layers:
        cuts.append(end - 1)
        end *= 4
    return tuple(cuts)


def launch_stages(num_layers: int) -> tuple[int, ...]:
    """The engine's cuts: `stage_cuts` with HYBRIDSERVE_STAGED_GRAPHS=1, none (one graph per step) by default: on the
    H200 the pieces gave 0.98-1.00x the one-graph step (bench/results/h200/decode_step/), no gain to pay for."""
    return stage_cuts(num_layers) if env_switch("HYBRIDSERVE_STAGED_GRAPHS", False) else ()


class DecodeGraphs:
    """Captured decode forwards of `model` over `cache`, one per bucket up to `max_batch`, each in pieces cut after
    `stages`' layers; `tokens` > 1: verify forwards of that many tokens per row with `rollback` ("intermediate" or
    "replay", as the engine speculates)."""

    def __init__(
        self, model: HybridLM, cache: StateCache, max_batch: int, max_pages_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS, tokens: int = 1, rollback: str | None = None,
        stages: tuple[int, ...] | None = None,
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
        # bucket -> (graph pieces, replayed in order, hidden [size * tokens, hidden], per-token SSM states of the
        # "intermediate" rollback)
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], torch.Tensor, dict[int, torch.Tensor]]] = {}
        # a new graph piece after each of these layers (None: launch_stages; (): one graph per step)
        self.stages = launch_stages(len(model.layers)) if stages is None else stages
        self.pool: Any = None
        self.num_replays = 0  # decode steps served by a graph
        self.num_eager_decodes = 0  # decode-only steps that had to run eagerly (a boundary row, a wide table)

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
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):  # warm-up: compiles / autotunes every kernel eagerly
                self.model(self.input_ids[: size * self.tokens], self._batch(size), self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.buckets):
            pieces, hidden, states = self._capture_pieces(size)
            self.graphs[size] = (pieces, hidden, states)

    def _capture_pieces(self, size: int) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor, dict[int, torch.Tensor]]:
        """One bucket's forward captured as consecutive graphs in the shared pool, cut after `self.stages`' layers;
        a piece's outputs stay alive (Python holds them) while the next is captured, so it reads them in replay."""
        if not self.stages:  # one graph per step
            graph = torch.cuda.CUDAGraph()
            whole = self._batch(size)
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(self.input_ids[: size * self.tokens], whole, self.cache)
            if self.pool is None:
                self.pool = graph.pool()
            return [graph], hidden, whole.intermediate_states
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        pieces: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self.pool)

        def cut(index: int) -> None:  # ForwardBatch.layer_done: called after layer `index`, mid-capture
            if index in self.stages:
                pieces[-1].capture_end()
                begin()

        batch = dataclasses.replace(self._batch(size), layer_done=cut)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()  # capture needs a stream other than the legacy default one
        with torch.cuda.stream(stream):
            begin()
            try:
                hidden = self.model(self.input_ids[: size * self.tokens], batch, self.cache)
            finally:
                pieces[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return pieces, hidden, batch.intermediate_states

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
    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [num_seqs * tokens, hidden] by graph replay, or None (caller runs the model eagerly)."""
        size = self.bucket_for(batch)
        if size is None:
            if batch.num_decode == batch.num_seqs:
                self.num_eager_decodes += 1
            return None
        return self.replay(size, input_ids, batch)

    @torch.inference_mode()
    def replay(self, size: int, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_seqs * tokens, hidden] of a decode-only batch by replaying bucket `size` (from
        `bucket_for`); a verify step's per-token SSM states go into `batch.intermediate_states` (views of the
        graph's buffers, valid until the next replay)."""
        self.num_replays += 1
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
        pieces, hidden, states = self.graphs[size]
        for piece in pieces:  # the GPU runs each piece while the host launches the next
            piece.replay()
        batch.intermediate_states.update({layer: s[:n] for layer, s in states.items()})
        return hidden[: n * t]


class PrefillReplay(Protocol):
    """What a GraphedModel calls on its prefill graphs (engine/prefill_graphs.py's PrefillGraphs, which imports
    this module, so this one names only the method it needs)."""

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None: ...


class GraphedModel:
    """Stands in for a HybridLM: decode-only batches replay a captured graph, mixed batches replay their decode
    rows' graph beside an eager prefill (`split_mixed`), everything else runs eagerly."""

    def __init__(self, model: HybridLM, graphs: DecodeGraphs, split_mixed: bool = True) -> None:
        self.model = model
        self.graphs = graphs
        self.split_mixed = split_mixed
        self.prefill: PrefillReplay | None = None  # set by engine/prefill_graphs.py's enable_prefill_graphs
        self.num_split_steps = 0  # mixed steps whose decode rows replayed a graph

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: StateCache) -> torch.Tensor:
        if cache is self.graphs.cache:
            hidden = self.graphs.run(input_ids, batch)
            if hidden is None and batch.num_decode == 0:
                hidden = self._prefill(input_ids, batch, cache)
            if hidden is not None:
                return hidden
            if self.split_mixed and self.splits(batch):
                decodes = batch.decode_half()
                size = self.graphs.bucket_for(decodes)
                if size is not None:
                    self.num_split_steps += 1
                    rows = batch.num_decode * batch.decode_len
                    decoded = self.graphs.replay(size, input_ids[:rows], decodes)
                    # [N, hidden]: the graphs' output buffers are rewritten by their next replays, so they are
                    # copied now (decode and prefill graphs keep separate memory pools)
                    prefill = batch.prefill_half()
                    prefilled = self._prefill(input_ids[rows:], prefill, cache)
                    if prefilled is None:
                        prefilled = self.model(input_ids[rows:], prefill, cache)
                    return torch.cat([decoded, prefilled])
        return self.model(input_ids, batch, cache)

    def _prefill(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: StateCache) -> torch.Tensor | None:
        """A prefill-only batch by prefill-graph replay, or None (no graph takes it: the caller runs it eagerly)."""
        return self.prefill.run(input_ids, batch) if self.prefill is not None else None  # the decode graphs' cache

    @staticmethod
    def splits(batch: ForwardBatch) -> bool:
        """Whether a batch is mixed in a way its decode (or verify) rows can replay a graph beside an eager prefill
        (not a prefill worker's layer-by-layer staging); `bucket_for` says the rest (token count, rollback)."""
        return 0 < batch.num_decode < batch.num_seqs and batch.layer_done is None

    def __getattr__(self, name: str) -> Any:  # compute_logits, config, parameters, ...
        return getattr(self.model, name)


def enable_decode_graphs(
    runner: Any, max_batch: int, max_pages_per_seq: int, split_mixed: bool = True, tokens: int = 1,
    rollback: str | None = None,
) -> DecodeGraphs | None:
    """Capture decode graphs (`tokens` > 1: verify graphs with `rollback`) for a ModelRunner on CUDA and route
    its forwards through them (`split_mixed`: mixed steps too, their one-token decode rows). A model whose step
    cannot be captured (a layer that syncs with the host) keeps running eagerly: returns None."""
    if runner.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
    graphs = DecodeGraphs(runner.model, runner.cache, max_batch, max_pages_per_seq, tokens=tokens, rollback=rollback)
    try:
        graphs.capture()
    except RuntimeError as exc:
        logger.warning("%s step not capturable as a CUDA graph, running eagerly: %s",
                       "verify" if tokens > 1 else "decode", exc)
        torch.cuda.synchronize()
        return None
    runner.model = GraphedModel(runner.model, graphs, split_mixed)
    return graphs


def graph_stats(runner: Any) -> dict[str, int]:
    """A ModelRunner's CUDA-graph counters (`LLMEngine.graph_stats`); 0 where no graph was captured."""
    graphed = runner.model
    graphs = getattr(graphed, "graphs", None)
    prefill = getattr(graphed, "prefill", None)
    return {"graph_decode_steps": getattr(graphs, "num_replays", 0),
            "eager_decode_steps": getattr(graphs, "num_eager_decodes", 0),
            "split_mixed_steps": getattr(graphed, "num_split_steps", 0),
            "folded_mixed_steps": runner.num_folded_steps,
            "graph_prefill_forwards": getattr(prefill, "num_replays", 0),
            "eager_prefill_forwards": getattr(prefill, "num_eager", 0)}
