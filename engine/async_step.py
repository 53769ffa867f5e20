"""Async scheduling (EngineConfig.async_scheduling, vLLM's `--async-scheduling`): step N+1 is scheduled, built and
launched while step N's forward still runs on the GPU, and the host applies step N's tokens (stop rules, outputs)
while step N+1 runs.

Step N's sampled tokens stay on the device: where step N+1 feeds one (a decode row, or a recomputed prompt that
ends with it), its input position is filled from step N's sample tensor by one device-side copy before the
forward. On the host the token is a placeholder in `output_token_ids` (`Request.num_inflight`) until step N's
copy to host lands; the scheduler meanwhile counts it as computed, so step N+1 schedules the row as a decode.
A request whose in-flight token is its last by length (max_tokens, max_model_len) is not scheduled again; one
that stops on EOS or a stop string wastes its row of step N+1, whose token is dropped. The prefix cache's commit
of step N (cached blocks, decode checkpoints) is queued right after step N's forward, before step N+1 touches the
state, and covers only tokens that were inputs, never a placeholder.

Scope: plain decoding and prefill chunks, in co-located steps (a multiplexed engine's whole-GPU steps too; its lane
steps run after the step in flight is applied, `flush`). Steps fall back to `LLMEngine.colocated_step`'s synchronous
path (after the step in flight is applied) while any request wants logprobs, prompt logprobs, a grammar, logits
processors (penalties, min_tokens, logit_bias) or keeps its state for export, and always with speculative decoding,
tensor parallelism or a multiplexed engine without whole-GPU steps (`fallback_reason`, logged at start-up).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridserve.common.outputs import RequestOutput
from hybridserve.engine.batch_builder import build_forward_batch
from hybridserve.engine.logits_processors import needs_processing
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.sampler import sample_tensor
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.engine.step_timing import StepClock
from hybridserve.kernels.host_index import pack_to_device

if TYPE_CHECKING:
    from collections.abc import Callable

    from hybridserve.engine.config import EngineConfig
    from hybridserve.engine.model_runner import ModelRunner
    from hybridserve.engine.scheduler import Scheduler
    from hybridserve.engine.spec_decode import SpecDecoder
    from hybridserve.engine.state_connector import StateConnector
    from hybridserve.engine.step_timing import StepTiming
    from hybridserve.statepool.pool import StatePool

logger = logging.getLogger(__name__)

class LLMEngine(Protocol):
    """The parts of engine/llm_engine.py's LLMEngine a stepper drives (a Protocol: that file imports this one)."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner
    pool: StatePool
    connector: StateConnector
    tokenizer: Any
    tp: Any
    last_step: StepTiming
    _requests: dict[str, Request]

    @property
    def spec(self) -> SpecDecoder | None: ...

    def _while_running(self, prefills: list[tuple[Request, int]], clock: StepClock,
                       on_launched: Callable[[], None] | None) -> Callable[[], None]: ...


PLACEHOLDER = -1  # an in-flight token's place in output_token_ids (never read as an input: see module docstring)


def fallback_reason(engine: LLMEngine) -> str | None:
    """Why this engine never steps asynchronously (None: it does, request by request)."""
    if engine.config.pd_multiplex and not engine.config.pd_multiplex_whole_gpu:
        return "every multiplexed step runs in the SM partitions' lanes, which overlap each other instead"
    if engine.spec is not None:
        return "speculative decoding verifies drafts against the host's tokens"
    if engine.tp is not None:
        return "tensor parallelism sends each step's inputs to the follower ranks from the host"
    return None


def plain(request: Request) -> bool:
    """Whether the request's rows can run a step ahead of its tokens (cached on the request)."""
    ok = request.plain
    if ok is None:
        p = request.params
        ok = request.plain = not (request.hold_state or request.grammar is not None or p.logprobs is not None
                                  or p.prompt_logprobs is not None or needs_processing(p))
    return ok


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    rows: list[tuple[Request, int]]  # (request, tokens) in row order, decodes first
    num_decode: int
    due: list[int]  # rows that sampled a token, in sample order
    sampled: torch.Tensor  # [len(due)] int64 on the device
    host: torch.Tensor  # [len(due)] int64: the host copy (pinned on CUDA), valid once `ready` completed
    ready: torch.cuda.Event | None  # None on the CPU: `host` is valid at once
    owners: list[tuple[Request, int]] = field(default_factory=list)  # (request, position in `sampled`) per placeholder
    index: dict[int, int] = field(default_factory=dict)  # id(request) -> its position in `sampled`
    final: set[Request] = field(default_factory=set)  # owners whose in-flight token is their last by length


def async_stepper(engine: LLMEngine) -> AsyncStepper | None:
    """The engine's async stepper, or None (logged) where it always steps synchronously."""
    reason = fallback_reason(engine)
    if reason is not None:
        logger.info("async scheduling off: every step runs synchronously here: %s", reason)
        return None
    logger.info("async scheduling: steps are scheduled one ahead of their tokens (requests with logprobs, grammars, "
                "logits processors or state export step synchronously)")
    return AsyncStepper(engine)


class AsyncStepper:
    """Drives `LLMEngine` one step ahead of its tokens; `step()` returns None where the synchronous step runs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self.num_async_steps = 0
        self.num_wasted_rows = 0  # rows launched for requests that had stopped on the step before
        self._pinned: list[torch.Tensor | None] = [None, None]  # host copies of the samples, alternating
        self._flip = 0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self, on_launched: Callable[[], None] | None) -> list[RequestOutput] | None:
        """Launch the next step and apply the one in flight. `engine.last_step` times this call (its phases:
        scheduling and launching step N+1, the wait for step N's tokens, applying them), with the shape of the
        step it launched (of the one it applied when it launched none)."""
        engine, prev = self.engine, self.inflight
        clock = StepClock()
        scheduler = engine.scheduler
        queues = (scheduler.running, scheduler.waiting, scheduler.landed)
        if not all(r.plain or (r.plain is None and plain(r)) for queue in queues for r in queue):
            return None if prev is None else self._resolve_only(prev, clock)
        scheduler.skip = prev.final if prev is not None else frozenset()
        try:
            work = scheduler.schedule()
        finally:
            scheduler.skip = frozenset()
        if work.is_empty:
            return [] if prev is None else self._resolve_only(prev, clock)
        launched = self._launch(work, prev, on_launched, clock)
        if prev is not None:
            outputs = self._resolve(prev, clock)
        else:
            outputs = []
            clock.execute_done()  # nothing to wait for yet
        self._advance(launched)
        self.inflight = launched
        self.num_async_steps += 1
        engine.last_step = clock.timing(launched.num_decode, _prefill_tokens(launched))
        return outputs

    def flush(self) -> list[RequestOutput]:
        """Apply the step in flight, if any, launching none (a multiplexed engine's lanes take over after it)."""
        return [] if self.inflight is None else self._resolve_only(self.inflight, StepClock())

    def _resolve_only(self, step: InFlight, clock: StepClock) -> list[RequestOutput]:
        """Apply the step in flight without launching another (the next steps run synchronously, or none is left)."""
        clock.schedule_done()
        clock.overlap_started()
        clock.overlap_ended()
        outputs = self._resolve(step, clock)
        self.engine.last_step = clock.timing(step.num_decode, _prefill_tokens(step))
        return outputs

    # ---- launch ---------------------------------------------------------------------------------
    def _launch(self, work: SchedulerOutput, prev: InFlight | None, on_launched: Callable[[], None] | None,
                clock: StepClock) -> InFlight:
        engine = self.engine
        runner = engine.runner
        prefills = [(c.request, c.num_tokens) for c in work.prefills]
        checkpoint_slots = engine.pool.plan_checkpoints(prefills)
        clock.schedule_done()
        rows = [(r, 1) for r in work.decodes] + prefills
        nd = len(work.decodes)
        try:
            input_ids, batch = build_forward_batch(rows, nd, runner.page_size, runner.device, runner.state_block,
                                                   checkpoint_slots)
            if prev is not None:
                self._feed(input_ids, rows, prev)
            hidden = runner.forward(input_ids, batch)  # [N, hidden]
            due = [i for i, (r, count) in enumerate(rows) if count == r.num_pending_tokens]
            sampled = self._sample(rows, due, hidden, batch.query_lens)  # queued before the host's overlap work
            engine._while_running(prefills, clock, on_launched)()
        except BaseException:
            engine.pool.cancel_plan()
            raise
        host, ready = self._to_host(sampled)
        return InFlight(rows, nd, due, sampled, host, ready)

    def _to_host(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of the samples on the host, queued behind the step (pinned buffers, two: the previous step's is
        read while this one's copy is in flight), and the event that says it landed."""
        if not sampled.is_cuda:
            return sampled, None
        n = sampled.shape[0]
        self._flip ^= 1
        buffer = self._pinned[self._flip]
        if buffer is None or buffer.shape[0] < n:
            buffer = self._pinned[self._flip] = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        host = buffer[:n]
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _feed(self, input_ids: torch.Tensor, rows: list[tuple[Request, int]], prev: InFlight) -> None:
        """Input positions holding a placeholder take the previous step's sample there (one device copy)."""
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        index = prev.index
        for request, count in rows:
            if request.num_inflight:
                source = index.get(id(request))
                last = len(request.prompt_token_ids) + len(request.output_token_ids) - 1  # the placeholder's position
                start = request.num_computed_tokens
                if source is not None and start <= last < start + count:
                    dst.append(offset + last - start)
                    src.append(source)
            offset += count
        if dst:
            to, frm = _to_device([dst, src], input_ids.device)
            input_ids[to] = prev.sampled[frm]

    def _sample(self, rows: list[tuple[Request, int]], due: list[int], hidden: torch.Tensor,
                query_lens: tuple[int, ...]) -> torch.Tensor:
        """One token per due row, left on the device ([len(due)] int64); plain rows need no logits processing."""
        runner = self.engine.runner
        if not due:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        ends = list(itertools.accumulate(query_lens))
        index = _to_device([[ends[i] - 1 for i in due]], runner.device)[0]
        logits = runner.compute_logits(hidden[index])  # [num_due, V]
        requests = [rows[i][0] for i in due]
        return sample_tensor(logits, [r.params for r in requests], [r.generator for r in requests],
                             runner.model.kernels)

    # ---- the host's side of a launched step ------------------------------------------------------
    def _advance(self, step: InFlight) -> None:
        """Count the launched step's tokens as computed and give each sampled row its placeholder; commit the step
        to the prefix cache (queued behind its forward). Rows of requests that stopped meanwhile are dropped."""
        engine = self.engine
        positions = {row: k for k, row in enumerate(step.due)}
        live: list[tuple[Request, int]] = []
        decodes: list[tuple[Request, int]] = []
        max_model_len = engine.scheduler.max_model_len
        finished = RequestStatus.FINISHED
        for i, (request, count) in enumerate(step.rows):
            if request.status is finished:
                self.num_wasted_rows += 1
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens = before + count
            live.append((request, count))
            if i < step.num_decode:
                decodes.append((request, before))
            position = positions.get(i)
            if position is not None:
                request.output_token_ids.append(PLACEHOLDER)
                request.num_inflight = 1
                step.index[id(request)] = position
                step.owners.append((request, position))
                num_output = len(request.output_token_ids)
                if num_output >= request.params.max_tokens or (
                        max_model_len is not None and len(request.prompt_token_ids) + num_output >= max_model_len):
                    step.final.add(request)
        engine.pool.commit([r for r, _ in live], decodes, None)

    def _resolve(self, step: InFlight, clock: StepClock) -> list[RequestOutput]:
        """Wait for the step's tokens on the host (the wait ends `clock`'s execution), put them in place of the
        placeholders and apply the stop rules; the requests' outputs, in sample order."""
        engine = self.engine
        scheduler = engine.scheduler
        self.inflight = None
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host.tolist()
        clock.execute_done()
        outputs: list[RequestOutput] = []
        for request, position in step.owners:
            token = tokens[position]
            request.num_inflight = 0
            if request.finished:  # aborted while its token was in flight
                request.output_token_ids.pop()
                continue
            request.output_token_ids[-1] = token
            reason = scheduler.stop_reason(request, token)
            if reason is not None:
                scheduler.finish(request, reason)
                engine._requests.pop(request.request_id, None)
                engine.connector.request_finished(request)
            outputs.append(request.output(engine.tokenizer))
        engine.connector.step_finished()
        return outputs


def _prefill_tokens(step: InFlight) -> int:
    return sum(count for _, count in step.rows[step.num_decode:])


def _to_device(arrays: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Small int64 index lists on the device, queued behind the step in flight: from pinned memory on CUDA (from
    pageable memory the driver may first wait for the stream, which would serialize the two steps)."""
    if device.type != "cuda":
        return pack_to_device(arrays, torch.int64, device)
    packed = torch.tensor([v for values in arrays for v in values], dtype=torch.int64).pin_memory()
    on_device = packed.to(device, non_blocking=True)
    out, offset = [], 0
    for values in arrays:
        out.append(on_device[offset : offset + len(values)])
        offset += len(values)
    return out
