"""Turns a `SchedulerOutput` into one forward over packed tokens and samples the requests that are due.

`ModelRunner.forward` is the one place a batch's path is chosen: a decode-only batch that fits a captured bucket
replays its decode (or verify) graph; a prefill-only batch that fits a prefill bucket replays a prefill graph; a
mixed batch (with `split_mixed`) replays its decode rows' graph beside the prefill rows' graph or eager forward;
everything else runs eagerly. Under tensor parallelism rank 0 first sends the forward to the followers, which take
the same path on their shards (engine/tp_worker.py). Speculative decoding lives here too: `execute` builds the
verify rows' inputs, and accepts their drafts once the forward ran (`SpecDecoder`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridserve.common.outputs import TokenLogprob
from hybridserve.engine.batch_builder import VerifyInputs, build_forward_batch
from hybridserve.engine.cuda_graphs import DecodeGraphs, capture_decode_graphs
from hybridserve.engine.logits_processors import process_logits
from hybridserve.engine.logprobs import gather_logprobs, sampled_logprobs
from hybridserve.engine.prefill_graphs import PrefillGraphs, capture_prefill_graphs
from hybridserve.engine.request import Request
from hybridserve.engine.sampler import sample
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.engine.spec_config import SpeculativeConfig
from hybridserve.engine.spec_decode import SpecDecoder
from hybridserve.engine.spec_memory import write_checkpoint_hidden
from hybridserve.engine.step_output import StepOutput
from hybridserve.engine.structured_output import GrammarBackend
from hybridserve.engine.tp_worker import Leader
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.state_cache import StateCache


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose forward is queued (`ModelRunner.launch`) and not yet sampled (`ModelRunner.finish`)."""

    work: SchedulerOutput
    chunks: list[tuple[Request, int]]  # (request, tokens it computes), decode rows first
    verify: VerifyInputs | None
    hidden: torch.Tensor  # [N, hidden], being computed
    batch: ForwardBatch
    checkpoint_slots: list[int]


@dataclass
class ForwardCounts:
    """Which path the runner's forwards took (`LLMEngine.graph_stats`)."""

    graph_decode_steps: int = 0  # decode (verify) steps replayed from a graph, split mixed steps' decode rows too
    eager_decode_steps: int = 0  # decode-only steps no graph took (a boundary row, a wide table, too many rows)
    split_mixed_steps: int = 0  # mixed steps whose decode rows replayed a graph beside their prefill rows
    graph_prefill_forwards: int = 0  # prefill forwards (a step's prefill chunks) replayed from a prefill graph
    eager_prefill_forwards: int = 0  # prefill forwards no prefill graph took (too large, too many sequences)


class ModelRunner:
    """Owns the model's forward on one device (rank 0 of a tensor-parallel group: with `tp`), its CUDA graphs and
    the speculative decoder. `split_mixed`: mixed steps replay their decode rows' graph (EngineConfig
    .split_mixed_steps; never under tensor parallelism, where every rank must take the same path)."""

    def __init__(
        self, model: HybridLM, cache: StateCache, page_size: int, device: torch.device, state_block: int | None = None,
        speculative: SpeculativeConfig | None = None, tp: Leader | None = None, split_mixed: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.page_size = page_size
        self.device = device
        self.state_block = state_block
        self.tp = tp
        self.split_mixed = split_mixed and tp is None
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.counts = ForwardCounts()
        self.grammar: GrammarBackend | None = None  # `use_grammar`, on the engine's first structured request
        if speculative is not None and speculative.rollback == "replay":
            cache.enable_replay(speculative.num_verify_tokens)
        self.spec = SpecDecoder(speculative, self, cache, page_size) if speculative is not None else None

    # ---- start-up -------------------------------------------------------------------------------
    def capture_graphs(self, max_batch: int, max_pages: int, prefill_tokens: int, prefill: bool) -> None:
        """Decode graphs (verify graphs when speculating) for up to `max_batch` rows, then (`prefill`) prefill
        graphs up to `prefill_tokens` beside them. Under tensor parallelism every rank captures its decode graphs in
        lockstep (the all-reduces inside them pair up); speculating there, verify steps run eagerly."""
        if self.tp is not None:
            if self.spec is None:
                self.decode_graphs = self.tp.capture_graphs(self.model, self.cache, max_batch, max_pages)
            return
        spec = self.spec
        self.decode_graphs = capture_decode_graphs(
            self.model, self.cache, max_batch, max_pages, tokens=spec.tokens if spec is not None else 1,
            rollback=spec.config.rollback if spec is not None else None)
        if prefill and self.decode_graphs is not None:
            assert self.state_block is not None  # an engine's runner
            self.prefill_graphs = capture_prefill_graphs(self.model, self.cache, max_pages, self.state_block,
                                                         prefill_tokens)

    def use_grammar(self, backend: GrammarBackend) -> None:
        """Apply grammar masks from now on (sampling and speculative verification)."""
        self.grammar = backend
        if self.spec is not None:
            self.spec.grammar = backend

    def graph_stats(self) -> dict[str, int]:
        return dict(vars(self.counts))

    # ---- the forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [N, hidden] of a packed batch, by the one path it takes (module docstring)."""
        if self.tp is None:
            return self._forward(input_ids, batch)
        self.tp.send_forward(input_ids, batch)  # the followers run the same path on their shards
        with self.tp.checked():  # a collective failing because a follower died raises as its RankError
            return self._forward(input_ids, batch)

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        graphs, counts = self.decode_graphs, self.counts
        if graphs is not None:
            size = graphs.bucket_for(batch)
            if size is not None:
                counts.graph_decode_steps += 1
                return graphs.replay(size, input_ids, batch)
            if batch.num_decode == batch.num_seqs:
                counts.eager_decode_steps += 1
            elif self.split_mixed and batch.num_decode and batch.layer_done is None:
                decodes = batch.decode_half()
                size = graphs.bucket_for(decodes)
                if size is not None:
                    counts.graph_decode_steps += 1
                    counts.split_mixed_steps += 1
                    rows = batch.num_decode * batch.decode_len
                    # [N, hidden]: the graphs' output buffers are rewritten by their next replays, so they are
                    # copied now (decode and prefill graphs keep separate memory pools)
                    decoded = graphs.replay(size, input_ids[:rows], decodes)
                    return torch.cat([decoded, self._prefill_forward(input_ids[rows:], batch.prefill_half())])
        if batch.num_decode == 0:
            return self._prefill_forward(input_ids, batch)
        return self.model(input_ids, batch, self.cache)

    def _prefill_forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A prefill-only batch: a prefill graph's replay where one takes it, else eagerly."""
        if self.prefill_graphs is not None:
            hidden = self.prefill_graphs.run(input_ids, batch)
            if hidden is not None:
                self.counts.graph_prefill_forwards += 1
                return hidden
            self.counts.eager_prefill_forwards += 1
        return self.model(input_ids, batch, self.cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] (under tensor parallelism every rank computes its vocabulary shard)."""
        if self.tp is not None:
            return self.tp.compute_logits(self.model, hidden)
        return self.model.compute_logits(hidden)

    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, batch: ForwardBatch,
                    cache: StateCache) -> torch.Tensor:
        """One pass of the MTP drafter ([N], [N, hidden] -> [N, hidden]), on every rank under tensor parallelism."""
        if self.tp is None:
            return self.model.mtp_forward(input_ids, prev_hidden, batch, cache)
        self.tp.send_mtp_forward(self.model, input_ids, prev_hidden, batch)
        with self.tp.checked():
            return self.model.mtp_forward(input_ids, prev_hidden, batch, cache)

    # ---- a step ----------------------------------------------------------------------------------
    def execute(
        self, work: SchedulerOutput, checkpoint_slots: list[int] | None = None,
        while_running: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run the step and sample every request whose pending tokens are now computed; speculating, the decode rows
        verify their drafts and keep the accepted ones. `checkpoint_slots`: from `StatePool.plan_checkpoints` for this
        step's prefill chunks; `while_running`: host work to do once the forward is queued, before the host waits for
        its tokens."""
        launched = self.launch(work, checkpoint_slots)
        if while_running is not None:
            while_running()
        return self.finish(launched)

    def launch(self, work: SchedulerOutput, checkpoint_slots: list[int] | None = None) -> LaunchedStep:
        """The step's inputs built and its forward queued on the current stream, without waiting for it."""
        nd = len(work.decodes)
        verify = self.spec.verify_inputs(work.decodes) if self.spec is not None else None
        tokens = len(verify.tokens[0]) if verify is not None and nd else 1
        chunks = [(r, tokens) for r in work.decodes] + [(c.request, c.num_tokens) for c in work.prefills]
        input_ids, batch = build_forward_batch(
            chunks, nd, self.page_size, self.device, self.state_block, checkpoint_slots, verify
        )
        return LaunchedStep(work, chunks, verify, self.forward(input_ids, batch), batch, checkpoint_slots or [])

    def finish(self, launched: LaunchedStep) -> StepOutput:
        """Logits and samples of a launched step (the host waits for its tokens here); speculating, acceptance."""
        work, nd = launched.work, len(launched.work.decodes)
        output = self._sample(launched.chunks, nd, launched.verify, launched.hidden, launched.batch)
        if self.spec is None:
            return output
        assert self.state_block is not None  # an engine's runner
        write_checkpoint_hidden(self.cache, work.prefills, launched.checkpoint_slots, output, nd, self.state_block)
        return self.spec.accept(work.decodes, output)

    def _sample(self, chunks: list[tuple[Request, int]], nd: int, verify: VerifyInputs | None, hidden: torch.Tensor,
                batch: ForwardBatch) -> StepOutput:
        """Verify logits for the verify rows; a token (and logprobs) for every other row whose prompt is done."""
        tokens = len(verify.tokens[0]) if verify is not None and nd else 1
        verify_logits = None
        if verify is not None and nd:
            verify_logits = self.compute_logits(hidden[: nd * tokens]).view(nd, tokens, -1)
        first_sampled = nd if verify is not None else 0
        due = [i for i in range(first_sampled, len(chunks)) if chunks[i][1] == chunks[i][0].num_pending_tokens]
        new_token_ids: list[list[int]] = [[] for _ in chunks]
        prompt_logprobs = self._prompt_logprobs(chunks, nd, hidden, batch)
        if not due:
            return StepOutput(hidden, batch, new_token_ids, verify_logits, first_sampled, None, prompt_logprobs)
        ends = list(itertools.accumulate(batch.query_lens))  # host copy of cu_seqlens[1:]
        rows = pack_to_device([[ends[i] - 1 for i in due]], torch.int64, self.device)[0]  # no stream sync
        last_hidden = hidden[rows]  # [num_due, hidden]
        requests = [chunks[i][0] for i in due]
        raw_logits = self.compute_logits(last_hidden)  # [num_due, V]; logprobs report these (as vLLM)
        logits = process_logits(raw_logits, [r.params for r in requests],
                                [(r.prompt_token_ids, r.output_token_ids) for r in requests],
                                self.model.config.eos_token_ids)
        if self.grammar is not None and any(r.grammar is not None for r in requests):
            logits = logits.float()
            self.grammar.apply(logits, [r.grammar for r in requests])
        for row, request in enumerate(requests):
            if request.hold_state:  # a prefill worker ships it to decode (the MTP drafter needs it)
                request.last_hidden = last_hidden[row]
        tokens_out = sample(logits, [r.params for r in requests], [r.generator for r in requests], self.model.kernels)
        for index, token in zip(due, tokens_out):
            new_token_ids[index] = [token]
        logprobs: list[list[TokenLogprob]] | None = None
        wanted = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if wanted:
            logprobs = [[] for _ in chunks]
            found = sampled_logprobs(raw_logits[torch.tensor(wanted, device=logits.device)],
                                     [requests[row].params for row in wanted], [tokens_out[row] for row in wanted])
            for row, entry in zip(wanted, found):
                logprobs[due[row]] = [entry]
        return StepOutput(hidden, batch, new_token_ids, verify_logits, first_sampled, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, chunks: list[tuple[Request, int]], num_decode: int, hidden: torch.Tensor,
                         batch: ForwardBatch) -> dict[int, tuple[int, list[TokenLogprob]]] | None:
        """Raw logprobs of the prompt tokens each prefill chunk predicts, for requests that asked: the logits
        at position q score prompt token q + 1 (only those rows go through the LM head)."""
        wanted = [i for i in range(num_decode, len(chunks)) if chunks[i][0].params.prompt_logprobs is not None]
        if not wanted:
            return None
        cu = batch.cu_seqlens.tolist()
        sources: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        spans: dict[int, tuple[int, int, int]] = {}  # row -> (first position, offset into targets, count)
        for i in wanted:
            request, count = chunks[i]
            start, prompt = request.num_computed_tokens, request.prompt_token_ids
            positions = range(start + 1, min(start + count + 1, len(prompt)))
            spans[i] = (start + 1, len(targets), len(positions))
            sources.extend(cu[i] + p - 1 - start for p in positions)
            targets.extend(prompt[p] for p in positions)
            num_top.extend([request.params.prompt_logprobs or 0] * len(positions))
        if not targets:
            return None
        logits = self.compute_logits(hidden[torch.tensor(sources, device=hidden.device)])  # [P, V]
        entries = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, num_top)
        return {i: (first, entries[offset : offset + n]) for i, (first, offset, n) in spans.items() if n}

    def prompt_logits(self, request: Request) -> torch.Tensor:
        """Logits at every prompt position [L, vocab] for a request holding its slot and pages (one pass)."""
        input_ids, batch = build_forward_batch([(request, request.num_tokens)], 0, self.page_size, self.device)
        return self.compute_logits(self.forward(input_ids, batch))
