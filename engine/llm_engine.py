"""The engine core: requests in, `step()` = schedule -> execute -> update, outputs out.

The scheduler picks the step's work, the `ModelRunner` runs its one forward (and, speculating, verifies the drafts)
and samples, the scheduler applies the new tokens (stop rules, the prefix cache's commit, speculative rollback and
the drafter's catch-up); the P/D state handoff is the `StateConnector`, called at fixed points.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve.common.block_hash import BlockHash
from hybridserve.common.model_config import DEFAULT_MAX_MODEL_LEN, ModelConfig
from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.common.text_stream import TextStream
from hybridserve.common.tokenizer import load_tokenizer
from hybridserve.engine import handoff, multiplex_setup, tp_launch, tp_worker
from hybridserve.engine.async_step import AsyncStepper, async_stepper
from hybridserve.engine.cache_plan import plan_engine_cache
from hybridserve.engine.config import DTYPES, EngineConfig
from hybridserve.engine.lane_scheduler import LaneScheduler
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput
from hybridserve.engine.spec_decode import SpecDecoder
from hybridserve.engine.split_profile import profile_splits
from hybridserve.engine.state_connector import StateConnector
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
        spec = config.speculative
        self.lookahead = spec.num_speculative_tokens if spec is not None else 0  # draft positions per decode row
        self.tp: tp_worker.Leader | None = None  # rank 0 of a tensor-parallel group (engine/tp_worker.py)
        self.model = self._load_model()
        self.model_config = self.model.config  # without MTP when not drafting with it or it has no weights
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        self.cache, self.pool = self._plan_cache()
        scheduler_class = LaneScheduler if config.pd_multiplex else Scheduler  # a batch per lane (engine/multiplex.py)
        self.scheduler = scheduler_class(self.pool, config.prefill_chunk_tokens, self.max_running, self.lookahead,
                                   config.max_num_batched_tokens, self.model_config.eos_token_ids, self.max_model_len)
        self.runner = ModelRunner(self.model, self.cache, config.page_size, config.torch_device, self.state_block,
                                  spec, self.tp, config.split_mixed_steps)
        # pd_multiplex: the prefill and decode lanes' step (None: co-located steps, also where no SM partitions exist)
        self.multiplexer = multiplex_setup.open_multiplexer(self)
        self._capture_graphs()
        self.connector = StateConnector(self)
        # structured outputs' compile pool: callers prepare a request's grammar on their thread, off the loop
        self.grammars = Grammars(self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids,
                                 self.tokenizer is not None, config)
        self._requests: dict[str, Request] = {}
        self.last_step = NO_STEP  # the last step's shape and phase times (a worker loop's metrics read it)
        self._counter = itertools.count()
        self._arrivals = itertools.count()
        # seeds of requests that bring none, drawn without a torch call: a torch op releases the GIL, and on a
        # worker's loop, with its I/O threads busy, taking it back cost ~1.4 ms per admitted request
        # (bench/results/cpu/host_step)
        self._seeds = random.Random(config.seed)
        self.async_steps: AsyncStepper | None = async_stepper(self) if config.async_scheduling else None
        self.warmup_report: WarmupReport | None = warm_up(self) if config.warmup_enabled else None
        if self.multiplexer is not None and config.warmup_enabled:  # every split's lanes timed before serving
            profile_splits(self, self.multiplexer)

    # ---- start-up steps -------------------------------------------------------------------------
    def _load_model(self) -> HybridLM:
        """The model's weights (rank 0's shard under tensor parallelism, the followers started); the MTP drafter
        only when speculating with it."""
        config = self.config
        spec = config.speculative
        with_mtp = spec is not None and spec.method == "mtp"  # else the drafter and its KV are left out
        if config.tensor_parallel_size > 1:
            self.tp, model = tp_launch.start_leader(self.model_dir, config)
            weakref.finalize(self, self.tp.shutdown)
            return model
        model_config = config.runtime_model_config(ModelConfig.from_dir(self.model_dir))
        if config.load_format == "dummy":
            if not with_mtp:
                model_config = dataclasses.replace(model_config, mtp_layer_types=())
            return dummy_model(model_config, config.torch_dtype, config.torch_device, config.seed, config.kernels)
        return load_model(self.model_dir, model_config, config.torch_dtype, config.torch_device, with_mtp,
                          kernels=config.kernels)

    def _load_tokenizer(self):  # noqa: ANN202 - the tokenizer or None (a checkpoint without one)
        tokenizer = load_tokenizer(self.model_dir)
        if tokenizer is not None and tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens, the model's vocab_size is {self.model_config.vocab_size}"
            )
        return tokenizer

    def _plan_cache(self) -> tuple[StateCache, StatePool]:
        """Size the state cache from the memory budget (KV pages, state slots, checkpoints) and build its pool;
        sets `state_block` and `max_running` (max_num_seqs, or fewer when the budget lowered the slot count;
        standby slots hold states outside the running batch)."""
        config, model_config = self.config, self.model_config
        ssm_dtype = DTYPES[model_config.ssm_state_dtype]
        mamba = model_config.mamba
        has_attention = bool(model_config.kv_layers())
        self.state_block = config.resolve_state_block(
            mamba.chunk_size if mamba else config.page_size, config.page_size if has_attention else None
        )
        layout = plan_engine_cache(model_config, config, self.max_model_len, self.state_block, self.lookahead,
                                   ssm_dtype, model=self.model if self.tp is None else None)
        cache: StateCache
        if self.tp is not None:
            self.tp.send_layout(layout)
            cache = tp_worker.MirroredStateCache(self.tp, model_config, layout, config.torch_dtype, ssm_dtype,
                                                 config.torch_device)
        else:
            cache = StateCache(model_config, layout, config.torch_dtype, ssm_dtype, config.torch_device)
        pool = StatePool(cache, self.state_block, config.enable_prefix_caching, config.max_cache_events)
        pool.keep_free_for(config.prefill_chunk_tokens)
        self.max_running = min(config.max_num_seqs, layout.num_slots)
        return cache, pool

    def _capture_graphs(self) -> None:
        """CUDA graphs of the decode (verify) step and, beside them, of prefill steps (cuda_graphs on CUDA)."""
        config = self.config
        if not (config.cuda_graphs and config.torch_device.type == "cuda"):
            return
        if self.spec is not None and self.tp is not None:
            logger.info("speculative decoding with tensor parallelism: verify steps run without CUDA graphs")
        capture = self.runner if self.multiplexer is None else self.multiplexer  # the lanes': in their partitions
        capture.capture_graphs(self.max_running, -(-self.max_model_len // config.page_size),
                               config.prefill_chunk_tokens, config.prefill_cuda_graphs)

    @property
    def spec(self) -> SpecDecoder | None:
        """The speculative decoder (the runner's), None when not speculating."""
        return self.runner.spec

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
        block_hashes: list[BlockHash] | None = None,
    ) -> str:
        """Queue a request; with `hold_state` it keeps its state after finishing until `export_state`, and
        `on_held(request_id)` then runs at the end of the step it finished in (`StateConnector.step_finished`).
        `bounded` (workers): CapacityError when `max_num_waiting` requests already wait. `block_hashes`:
        `pool.prompt_hashes(prompt_token_ids)`, computed by the caller's thread (a worker's request reader) so that
        the loop does not hash."""
        if bounded and len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise handoff.CapacityError(f"{len(self.scheduler.waiting)} requests already wait for a slot on this worker "
                                f"(max_num_waiting={self.config.max_num_waiting}); try later or another worker")
        request = self._new_request(prompt_token_ids, params, request_id)
        request.hold_state = hold_state
        if block_hashes is not None and len(block_hashes) == request.num_tokens // self.pool.block_size:
            request.block_hashes = block_hashes
        self._requests[request.request_id] = request
        if hold_state:
            self.connector.register(request, on_held)
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
        if request_id in self._requests or self.connector.owns(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
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
            self.runner.use_grammar(backend)
        return backend.matcher(params.structured)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued, running, reserved, held); False if it is unknown."""
        if self.multiplexer is not None and self.multiplexer.defer_abort(request_id):
            return True  # its prefill forward is in flight: aborted once that completed
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.connector.abort(request_id)
            self.scheduler.finish(request, "abort")
            return True
        return self.connector.abort(request_id) or request is not None

    def close(self) -> None:
        """Stop the tensor-parallel follower ranks (nothing to do at tensor_parallel_size=1)."""
        if self.tp is not None:
            self.tp.shutdown()
        self.grammars.close()

    # ---- state handoff between a prefill and a decode engine (the connector's) ------------------------
    def state_specs(self, num_tokens: int) -> list[StateTensorSpec]:
        return self.connector.state_specs(num_tokens)

    def export_state(self, request_id: str, into: dict[str, torch.Tensor] | None = None) -> handoff.ExportedState:
        """Gather a finished `hold_state` request's state (device copies, into `into`'s views when given) and
        release its pages and slot."""
        return self.connector.export_state(request_id, into)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Pages and a slot for a request whose prefill runs elsewhere; CapacityError when full now."""
        self.connector.reserve(self._new_request(prompt_token_ids, params, request_id))

    def commit_reservation(
        self, request_id: str, tensors: dict[str, torch.Tensor], first_token: int, num_cached_tokens: int
    ) -> RequestOutput:
        """Install the received state; the request joins the running batch (or finishes on its first token)."""
        return self.connector.commit(request_id, tensors, first_token, num_cached_tokens)

    def admit_landed(self, request: Request) -> None:
        """A request whose state arrived joins the running batch when a seat is free (the connector's commit)."""
        self._requests[request.request_id] = request
        self.scheduler.add_landed(request)

    def finish_landed(self, request: Request, reason: str) -> None:
        """A landed request that stopped on its first token."""
        self.scheduler.finish(request, reason)
        self._requests.pop(request.request_id, None)

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
        steps included), decode-only steps that ran eagerly, mixed steps split into a replay and a prefill
        forward, and prefill forwards (a step's prefill chunks) replayed from a prefill graph or run eagerly beside
        them (all 0 without graphs)."""
        return self.runner.graph_stats()

    @property
    def step_in_flight(self) -> bool:
        """An async step is launched whose tokens the host has not applied yet."""
        return self.async_steps is not None and self.async_steps.busy

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.step_in_flight

    # ---- the loop -------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule -> execute (one forward; speculating, verify and accept) -> update; returns updated requests.
        `on_launched` runs once the forward is queued, while the GPU computes it (a worker loop hands the previous
        step's outputs to their streams there); not called when the step queues no forward."""
        if self.multiplexer is not None:
            return self.multiplexer.step(on_launched)
        return self.colocated_step(on_launched)

    def colocated_step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One co-located step on the whole GPU, a mixed batch of decode rows and prefill chunks in one forward: a
        step ahead of its tokens where async scheduling applies, else synchronous (also a multiplexed engine's step
        while its lanes would leave SMs idle: engine/sm_split.py)."""
        self.last_step = NO_STEP
        if self.async_steps is not None and (ahead := self.async_steps.step(on_launched)) is not None:
            return ahead  # engine/async_step.py; None: this step runs synchronously
        clock = StepClock()
        work = self.scheduler.schedule()
        if work.is_empty:
            return []
        prefills = [(c.request, c.num_tokens) for c in work.prefills]
        checkpoint_slots = self.pool.plan_checkpoints(prefills)
        clock.schedule_done()
        try:
            running = self._while_running(prefills, clock, on_launched)
            output = self.runner.execute(work, checkpoint_slots, while_running=running)
        except BaseException:
            self.pool.cancel_plan()
            raise
        clock.execute_done()
        updated = self._update(work, output)
        self.last_step = clock.timing(len(work.decodes), sum(count for _, count in prefills))
        return updated

    def _while_running(self, prefills: list[tuple[Request, int]], clock: StepClock,
                       on_launched: Callable[[], None] | None) -> Callable[[], None]:
        """Host work hidden behind the forward's GPU time: the caller's, then the prefix cache's."""

        def while_running() -> None:
            clock.overlap_started()
            if on_launched is not None:
                on_launched()
            self.pool.commit_prefills(prefills)
            self.pool.evict_ahead()
            self.scheduler.prepare_waiting()
            clock.overlap_ended()

        return while_running

    def _update(self, work: SchedulerOutput, output: StepOutput) -> list[RequestOutput]:
        """Apply the step's tokens (the scheduler: stops, cache commit, speculative rollback and catch-up), retire
        finished requests (held ones to the connector) and run the connector's end-of-step callbacks."""
        update = self.scheduler.update_from_output(work, output, self.runner.spec)
        outputs = []
        for request in update.updated:
            if request.finished:
                self._requests.pop(request.request_id, None)
                self.connector.request_finished(request)
            outputs.append(request.output(self.tokenizer))
        self.connector.step_finished()
        return outputs

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
