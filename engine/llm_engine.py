"""The engine loop: requests in, `step()` runs one scheduled forward, outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from hybridserve.common.block_hash import BlockHash
from hybridserve.common.model_config import DEFAULT_MAX_MODEL_LEN, ModelConfig
from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.common.tokenizer import load_tokenizer
from hybridserve.engine import handoff, tp_handoff, tp_worker
from hybridserve.engine.cache_plan import plan_engine_cache
from hybridserve.engine.config import DTYPES, EngineConfig
from hybridserve.engine.cuda_graphs import enable_decode_graphs, graph_stats
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.mtp_drafter import CatchUp
from hybridserve.engine.prefill_graphs import enable_prefill_graphs
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.spec_decode import SpecDecoder
from hybridserve.engine.spec_memory import write_checkpoint_hidden
from hybridserve.engine.step_output import StepOutput
from hybridserve.engine.step_timing import NO_STEP, StepClock
from hybridserve.engine.structured_output import Grammars
from hybridserve.engine.warmup import WarmupReport, warm_up
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.weights import dummy_model, load_model
from hybridserve.statepool.events import CacheEvent
from hybridserve.statepool.pool import NO_HIT, StatePool
from hybridserve.statepool.state_cache import StateCache
from hybridserve.transfer.state_layout import StateTensorSpec

logger = logging.getLogger(__name__)



class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        device = config.torch_device
        spec = config.speculative
        with_mtp = spec is not None and spec.method == "mtp"  # else the drafter and its KV are left out
        model_config = config.cache_dtypes(ModelConfig.from_dir(self.model_dir))
        self.tp: tp_worker.Leader | None = None  # rank 0 of a tensor-parallel group (engine/tp_worker.py)
        if config.tensor_parallel_size > 1:
            self.tp, model = tp_worker.start_leader(self.model_dir, config)
            weakref.finalize(self, self.tp.shutdown)
            self.model = cast(HybridLM, model)
        elif config.load_format == "dummy":
            if not with_mtp:
                model_config = dataclasses.replace(model_config, mtp_layer_types=())
            self.model = dummy_model(model_config, config.torch_dtype, device, config.seed)
        else:
            self.model = load_model(self.model_dir, model_config, config.torch_dtype, device, with_mtp)
        self.model_config = self.model.config  # without MTP when not drafting with it or it has no weights
        lookahead = spec.num_speculative_tokens if spec is not None else 0
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens, the model's vocab_size is "
                f"{self.model_config.vocab_size}"
            )
        self.max_model_len = (
            config.max_model_len or self.model_config.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        )
        ssm_dtype = DTYPES[self.model_config.ssm_state_dtype]
        mamba = self.model_config.mamba
        has_attention = bool(self.model_config.kv_layers())
        self.state_block = config.resolve_state_block(
            mamba.chunk_size if mamba else config.page_size, config.page_size if has_attention else None
        )
        layout = plan_engine_cache(self.model_config, config, self.max_model_len, self.state_block, lookahead, ssm_dtype,
                                   model=self.model if self.tp is None else None)
        self.cache: StateCache
        if self.tp is not None:
            self.tp.send_layout(layout)
            self.cache = tp_worker.MirroredStateCache(self.tp, self.model_config, layout, config.torch_dtype,
                                                      ssm_dtype, device)
        else:
            self.cache = StateCache(self.model_config, layout, config.torch_dtype, ssm_dtype, device)
        self.pool = StatePool(self.cache, self.state_block, config.enable_prefix_caching, config.max_cache_events)
        self.pool.keep_free_for(config.prefill_chunk_tokens)
        # the running batch: max_num_seqs, or fewer when the budget lowered the slot count; standby slots hold
        # states outside it
        self.max_running = min(config.max_num_seqs, layout.num_slots)
        self.scheduler = Scheduler(self.pool, config.prefill_chunk_tokens, self.max_running, lookahead,
                                   config.max_num_batched_tokens, self.model_config.eos_token_ids, self.max_model_len)
        self.runner = ModelRunner(self.model, self.cache, config.page_size, device, self.state_block,
                                  fold_decode_rows=config.fold_decode_rows)
        self.spec: SpecDecoder | None = None
        if spec is not None:
            if spec.rollback == "replay":
                self.cache.enable_replay(spec.num_verify_tokens)
            self.spec = SpecDecoder(spec, self.model, self.cache, config.page_size)
        self.lookahead = lookahead
        if config.cuda_graphs and device.type == "cuda":
            max_pages = -(-self.max_model_len // config.page_size)
            if self.spec is not None and self.tp is not None:
                logger.info("speculative decoding with tensor parallelism: verify steps run without CUDA graphs")
            elif self.spec is not None:  # every decode step is a verify step of T tokens per row
                enable_decode_graphs(self.runner, self.max_running, max_pages, config.split_mixed_steps,
                                     tokens=self.spec.tokens, rollback=self.spec.config.rollback)
            elif self.tp is not None:  # every rank captures, the all-reduces inside the graphs
                self.tp.capture_graphs(cast(tp_worker.LeaderModel, self.model), self.cache, self.max_running, max_pages)
            else:
                enable_decode_graphs(self.runner, self.max_running, max_pages, config.split_mixed_steps)
            if config.prefill_cuda_graphs:  # beside decode graphs (not under tensor parallelism)
                enable_prefill_graphs(self.runner.model, max_pages, self.state_block, config.prefill_chunk_tokens,
                                      self.max_running if config.fold_decode_rows else 0)
        # structured outputs' compile pool: callers prepare a request's grammar on their thread, off the loop
        self.grammars = Grammars(self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids,
                                 self.tokenizer is not None, config)
        self._requests: dict[str, Request] = {}
        self._held: dict[str, Request] = {}  # finished, state kept for export
        self.last_step = NO_STEP  # the last step's shape and phase times (a worker loop's metrics read it)
        self._hooks: dict[str, handoff.HandoffHooks] = {}  # held requests' callbacks, until they finish
        self._reserved: dict[str, Request] = {}  # pages and slot waiting for a remote prefill's state
        self._counter = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.warmup_report: WarmupReport | None = warm_up(self) if config.warmup_enabled else None

    # ---- requests -------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        """Clear ValueErrors for prompts the model cannot take."""
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is max_model_len="
                f"{self.max_model_len} tokens, prompt plus at least one generated token"
            )
        return list(prompt_token_ids)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} ships no tokenizer: pass prompt_token_ids instead of text")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_state: bool = False,
        on_held: Callable[[str], None] | None = None,
        bounded: bool = False,
        on_progress: Callable[[Request], None] | None = None,
        on_layer: Callable[[Request, int], None] | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> str:
        """Queue a request; with `hold_state` it keeps its state after finishing until `export_state`.
        `on_held(request_id)` then runs at the end of the step it finished in (e.g. to export the state right
        there: no extra trip to the loop, pages and slot free a step sooner). `on_progress(request)` runs at the
        end of every step that computed a chunk of its prompt without finishing it (a prefill worker stages the
        KV of the tokens computed so far: `request.num_computed_tokens`). `on_layer(request, layer)` runs inside
        the forward that computes the prompt's last chunk, right after each layer was queued (that layer's state
        of the prompt is then final: a prefill worker stages it while later layers compute; `request` still
        counts the chunk as pending). `bounded` (workers): CapacityError
        when `max_num_waiting` requests already wait. `block_hashes`: `pool.prompt_hashes(prompt_token_ids)`,
        computed by the caller's thread (a worker's request reader) so that the loop does not hash."""
        if bounded and len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise handoff.CapacityError(f"{len(self.scheduler.waiting)} requests already wait for a slot on this worker "
                                f"(max_num_waiting={self.config.max_num_waiting}); try later or another worker")
        request = self._new_request(prompt_token_ids, params, request_id)
        request.hold_state = hold_state
        if block_hashes is not None and len(block_hashes) == request.num_tokens // self.pool.block_size:
            request.block_hashes = block_hashes
        self._requests[request.request_id] = request
        if hold_state and (on_held or on_progress or on_layer):
            self._hooks[request.request_id] = handoff.HandoffHooks(on_held, on_progress, on_layer)
        self.scheduler.add(request)
        return request.request_id

    def _new_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None) -> Request:
        tokens = self.validate_prompt(prompt_token_ids)
        needed = min(len(tokens) + params.max_tokens, self.max_model_len) + self.lookahead
        if not self.pool.fits_ever(needed):
            raise ValueError(
                f"the request needs KV for {needed} tokens (prompt {len(tokens)} + max_tokens {params.max_tokens}), "
                f"the KV pool holds {self.pool.num_pages * self.pool.page_size} tokens in all: lower max_tokens, "
                "shorten the prompt, or give the cache more memory"
            )
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        grammar = self._grammar_matcher(params)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need the model's tokenizer; {self.model_dir} ships none (use stop_token_ids)")
        request_id = request_id if request_id is not None else f"req-{next(self._counter)}"
        if request_id in self._requests or request_id in self._held or request_id in self._reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        request = Request(request_id, tokens, params, seed, arrival=next(self._arrivals))
        request.grammar = grammar
        if params.stop:  # matched on the worker, so a stopped request generates no further tokens
            request.stop_text = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return request

    def _grammar_matcher(self, params: SamplingParams):  # noqa: ANN202 - xgrammar GrammarMatcher | None
        """The request's grammar matcher; its grammar compiles off the loop (`grammars.prepare`, which served
        callers run on their own thread first), so here it is a cache hit."""
        if params.structured is None:
            return None
        backend = self.grammars.backend()
        if self.runner.grammar is None:
            self.runner.grammar = backend
            if self.spec is not None:
                self.spec.grammar = backend
        return backend.matcher(params.structured)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued, running, reserved, held); False if it is unknown."""
        self._hooks.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")
            return True
        parked = self._held.pop(request_id, None) or self._reserved.pop(request_id, None)
        if parked is not None:
            self.pool.release(parked)
            return True
        return request is not None

    def close(self) -> None:
        """Stop the tensor-parallel follower ranks (nothing to do at tensor_parallel_size=1)."""
        if self.tp is not None:
            self.tp.shutdown()
        self.grammars.close()

    # ---- state handoff between a prefill and a decode engine --------------------------------------
    def state_specs(self, num_tokens: int) -> list[StateTensorSpec]:
        if self.tp is not None:  # the unsharded layout: P/D between any TP sizes
            return tp_handoff.state_specs(self, num_tokens)
        return handoff.state_specs(self, num_tokens)

    def export_state(self, request_id: str, into: dict[str, torch.Tensor] | None = None) -> handoff.ExportedState:
        """Gather a finished `hold_state` request's state (device copies, into `into`'s views when given) and
        release its pages and slot."""
        request = self._held.pop(request_id, None)
        if request is None:
            raise ValueError(f"no held state for request {request_id!r}")
        if self.tp is not None:
            return tp_handoff.export_state(self, request, into)
        return handoff.export_state(self, request, into)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Pages and a slot for a request whose prefill runs elsewhere; CapacityError when full now."""
        request = self._new_request(prompt_token_ids, params, request_id)
        handoff.reserve(self, request)
        self._reserved[request.request_id] = request

    def commit_reservation(
        self, request_id: str, tensors: dict[str, torch.Tensor], first_token: int, num_cached_tokens: int
    ) -> RequestOutput:
        """Install the received state; the request joins the running batch (or finishes on its first token)."""
        request = self._reserved.pop(request_id, None)
        if request is None:
            raise ValueError(f"no reservation for request {request_id!r} (aborted or expired)")
        (tp_handoff if self.tp is not None else handoff).commit(self, request, tensors, first_token, num_cached_tokens)
        if request.grammar is not None:  # the prefill worker sampled it under the same grammar
            request.grammar.accept_token(first_token)
        self._requests[request_id] = request
        self.scheduler.add_landed(request)
        reason = self.scheduler.stop_reason(request, first_token)
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._requests.pop(request_id, None)
        elif self.spec is not None:  # drafts for the first verify: the drafter's slot of the first token
            last = cast(torch.Tensor, request.last_hidden)  # set by the commit above
            empty = last.new_zeros((0, last.shape[-1]))
            if self.pool.reserve(request, request.num_tokens + self.lookahead):
                n = request.num_computed_tokens
                self.spec.catch_up([CatchUp(request, n, n, empty, True)])
        return request.output(self.tokenizer)

    def stats(self) -> dict[str, int]:
        """Load figures for health checks and routing."""
        pages = self.pool.pages
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.landed),
            "free_state_slots": self.pool.num_free_slots,
            "free_kv_pages": pages.num_free if pages is not None else 0,
            "queued_prefill_tokens": sum(r.num_pending_tokens for r in self.scheduler.waiting),
        }

    def graph_stats(self) -> dict[str, int]:
        """Decode steps (verify steps when speculating) replayed from a CUDA graph (the decode rows of split mixed
        steps included), decode-only steps that ran eagerly, mixed steps split into a replay and an eager prefill
        (0 without graphs), mixed steps whose decode rows were folded into the prefill forward, and prefill forwards
        (a step's prefill chunks) replayed from a prefill graph or run eagerly beside them."""
        return graph_stats(self.runner)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule, run one forward, accept / sample, apply stop rules, draft; returns updated requests.
        `on_launched` runs once the forward is queued, while the GPU computes it (a worker loop hands the previous
        step's outputs to their streams there); not called when the step queues no forward."""
        clock = StepClock()
        self.last_step = NO_STEP
        work = self.scheduler.schedule()
        if work.is_empty:
            return []
        verify = self.spec.verify_inputs(work.decodes) if self.spec is not None else None
        prefills = [(c.request, c.num_tokens) for c in work.prefills]
        checkpoint_slots = self.pool.plan_checkpoints(prefills)

        def while_running() -> None:  # the prefix cache's host work, hidden behind the forward's GPU time
            clock.overlap_started()
            if on_launched is not None:
                on_launched()
            self.pool.commit_prefills(prefills)
            self.pool.evict_ahead()
            self.scheduler.prepare_waiting()
            clock.overlap_ended()

        clock.schedule_done()
        try:
            output = self.runner.execute(work, checkpoint_slots, verify,
                                         handoff.layer_hook(self._hooks, work.prefills) if self._hooks else None,
                                         while_running=while_running)
        except BaseException:
            self.pool.cancel_plan()
            raise
        if self.spec is not None:
            write_checkpoint_hidden(self.cache, work.prefills, checkpoint_slots, output, len(work.decodes),
                                    self.state_block)
            output = self.spec.accept(work.decodes, output)
        clock.execute_done()
        update = self.scheduler.update_from_output(work, output, self.spec)
        updated: list[RequestOutput] = []
        for request in update.updated:
            if request.finished:
                self._requests.pop(request.request_id, None)
                if request.hold_state:
                    self._held[request.request_id] = request
            updated.append(request.output(self.tokenizer))
        if self.spec is not None and self.spec.mtp is not None:
            self.spec.catch_up(self._catch_up_work(update.rows, update.before, output))
        for out in updated:
            hooks = self._hooks.pop(out.request_id, None) if out.request_id in self._held else None
            if hooks is not None and hooks.on_held is not None:
                hooks.on_held(out.request_id)
        if self._hooks:
            handoff.progress(self._hooks, work.prefills)
        self.last_step = clock.timing(len(work.decodes), sum(c.num_tokens for c in work.prefills))
        return updated

    def _catch_up_work(self, chunks: list[tuple[Request, int]], before: list[int], output: StepOutput) -> list[CatchUp]:
        """The drafter's work after a step: every request that holds its slot and computed tokens."""
        work = []
        cu = output.batch.cu_seqlens.tolist()
        for index, (request, _) in enumerate(chunks):
            start, done = before[index], request.num_computed_tokens
            if request.state_slot is None or done == start:
                continue
            rows = output.hidden[cu[index] : cu[index] + done - start]
            draft = request.status is RequestStatus.RUNNING and request.is_decoding
            draft = draft and self.pool.reserve(request, request.num_tokens + self.lookahead)
            work.append(CatchUp(request, start, done if draft else done - 1, rows, draft))
        return work

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position [L, vocab] in one pass (scoring; no generation)."""
        tokens = self.validate_prompt(prompt_token_ids)
        request = Request("score", tokens, SamplingParams(max_tokens=1), seed=0, arrival=-1)
        if not self.pool.admit(request, NO_HIT, len(tokens)):
            raise ValueError(f"no free state slot or not enough free KV pages to score {len(tokens)} tokens now")
        try:
            return self.runner.prompt_logits(request)
        finally:
            self.pool.release(request)

    # ---- prefix cache ---------------------------------------------------------------------------
    def drain_cache_events(self) -> list[CacheEvent]:
        """Stored / removed block hashes and checkpoints since the last call, in sequence order."""
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running request holds."""
        self.pool.clear_cache()
