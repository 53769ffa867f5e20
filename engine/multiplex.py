"""PD multiplexing: one engine runs a prefill forward and a decode forward at once, each launching on its own SM
partition (a lane of engine/sm_partition.py), with one copy of the weights and one state pool.

A step variant of the engine core (`LLMEngine.step` is schedule -> execute -> update), on the engine's one thread.
While one phase has no work, or a deep backlog drains, the controller (engine/sm_split.py) has a call run the
co-located step on the whole GPU instead (after the lanes' queued work; the lanes' next work after it); it is asked
when a call starts with no prefill forward in flight and no split pinned, and when a prefill forward is taken
beside a decode step (step 3). Otherwise each call:
1. the decode-only batch of the decoding requests is scheduled and launched on the decode lane (first, so that the
   prefill's host work below overlaps the decode step on the GPU);
2. when no prefill forward is in flight, the split may change (engine/sm_split.py; then the next decode step runs
   in the new split's lanes), and a prefill-only batch is scheduled and launched on the prefill lane, without
   waiting for it;
3. the host waits for the decode step's tokens and applies them (outputs, stops, cache commit, drafts); while it
   waits, a prefill forward that completes is taken (step 4) and the next one launched in the same split, so the
   prefill lane does not idle until the decode step ends (unless the controller changes the split then, whose
   graphs follow once the step is done, or turns to the whole GPU, or too little of the step is left for a launch);
4. the prefill forward's completion is polled (waited for when nothing decodes); once done, its first tokens are
   sampled and applied. A request whose prompt is done is now decoding: the decode lane takes it at its next step
   with the same pages and Mamba slot (ownership passes, no bytes move); the prefill lane never schedules it again.

What the two forwards in flight do not share:
- inputs and scratch: each launch builds its own batch tensors on its lane's stream; the decode graphs (static
  inputs, their memory pool) serve the decode lane only, the prefill graphs (their own pool) the prefill lane only;
- the pool's checkpoint plan: the prefill forward's plan leaves the pool at launch and comes back for its own
  commit, and its blocks and checkpoints are filed only once it completed (filed early, the decode lane's commit
  could evict a checkpoint still being written and reuse its slot);
- requests: each is in one lane (engine/lane_scheduler.py); one in flight is never preempted, and its abort waits
  for the forward to complete before its pages and slot are freed.
The lanes are ordered by events where one reads what the other wrote: decode's update waits for prefill's admission
copies (cached checkpoint -> slot: its commit may evict that checkpoint and reuse the slot) and for the tail of a
prefill update taken while the decode step ran (the checkpoints it filed, the pages it freed), decode's next forward
for the tail of prefill's update (sampling, drafter catch-up, freed pages); prefill's admission waits for the tail
of the decode update (checkpoints it may copy from, pages it freed). The decode forward in flight while prefill
schedules reads only its own rows' pages and slots, which admission never hands out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from hybridserve.common.outputs import RequestOutput
from hybridserve.engine.async_step import AsyncStepper
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.lane_counters import LaneCounters
from hybridserve.engine.lane_flight import DecodeInFlight, Fence, PrefillInFlight
from hybridserve.engine.lane_graphs import LaneGraphs, capture_lane_graphs
from hybridserve.engine.lane_scheduler import LaneScheduler
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput
from hybridserve.engine.sm_partition import Lane, SmPartitioner, SmSplit
from hybridserve.engine.sm_split import SplitController
from hybridserve.engine.step_output import StepOutput
from hybridserve.engine.step_timing import StepClock, StepTiming
from hybridserve.statepool.pool import StatePool

logger = logging.getLogger(__name__)

# The skinny linear kernel takes inputs of up to 16 rows and may split K through a workspace kept per weight
# (kernels/skinny_linear_triton.py), which two launches in flight must not share: a prefill forward that small runs
# between two decode steps instead of beside one (larger ones take cuBLAS, or a prefill graph's 64+ token buckets).
SPLIT_K_ROWS = 16
PREFILL_POLL_S = 2e-4  # how often the host looks at both lanes while a decode step and a prefill forward run


class MultiplexedEngine(Protocol):
    """What the multiplexer uses of its engine (`LLMEngine`)."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner
    pool: StatePool
    multiplexer: Multiplexer | None
    last_step: StepTiming
    async_steps: AsyncStepper | None

    def abort(self, request_id: str) -> bool: ...

    def colocated_step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]: ...

    def _update(self, work: SchedulerOutput, output: StepOutput) -> list[RequestOutput]: ...


class Multiplexer:
    """The multiplexed step of one engine (module docstring); `LLMEngine.step` hands over to `step`."""

    def __init__(self, engine: MultiplexedEngine, scheduler: LaneScheduler, partitioner: SmPartitioner,
                 controller: SplitController) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.runner = engine.runner
        self.pool = engine.pool
        self.partitioner = partitioner
        self.controller = controller
        self.update = engine._update  # tokens applied, finished requests retired, outputs made
        self.pinned: SmSplit | None = None  # a split held by `pin` (the start-up profile), not the controller's
        self.prefill_delay = 0  # tests: iterations a (fake) lane's completed prefill stays unseen
        self.iteration = 0
        self.in_flight: PrefillInFlight | None = None
        self.counters = LaneCounters.for_menu(partitioner.splits, partitioner.total_sms)
        self.whole = False  # the last step ran co-located on the whole GPU
        self.graphs: dict[SmSplit, LaneGraphs] = {}  # per split, captured in its lanes (CUDA: `capture_graphs`)
        self.whole_graphs: LaneGraphs | None = None  # the co-located graphs, for whole-GPU steps
        self._admitted: Fence | None = None  # prefill's admission copies, for the decode lane to wait on
        self._prefill_tail: Fence | None = None  # the end of prefill's last update
        self._decode_tail: Fence | None = None  # the end of decode's last update
        self._beside_tail: Fence | None = None  # the end of a prefill update taken while a decode step ran
        self._graphs_stale = False  # the split changed while a decode step ran: switch graphs after it
        self._prefill_launch_ms = 0.0  # host time of the last prefill launch

    @property
    def split(self) -> SmSplit:
        """The split in effect: the controller's (changed only while no prefill forward is in flight)."""
        return self.controller.current

    def lanes(self) -> tuple[Lane, Lane]:
        """(prefill lane, decode lane) of the split in effect."""
        return self.partitioner.lanes(self.split)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One iteration (module docstring); returns the requests updated by the decode step and, once it completed,
        by the prefill forward. `on_launched` runs once this iteration's forwards are queued."""
        self.iteration += 1
        load = self.scheduler.load() if self.in_flight is None else None
        if load is not None and self._whole_next(load):
            return self._whole_step(on_launched)
        outputs: list[RequestOutput] = []
        if self.whole:
            outputs = self._leave_whole()
            if load is not None:  # the step it applied may have retired requests
                load = self.scheduler.load()
        clock = StepClock()
        if load is not None:
            self._choose_split(load)
        prefill_lane, decode_lane = self.lanes()
        decode = self._schedule_decode(decode_lane)
        clock.schedule_done()
        launched = self._launch_decode(decode_lane, decode) if decode is not None else None
        # the prefill's host work (scheduling, its launches) overlaps the decode step on the GPU
        launched_prefill = self.in_flight is None and self._launch_prefill(prefill_lane, decode_lane)
        clock.overlap_started()
        if on_launched is not None and (launched_prefill or launched is not None):
            on_launched()
        self.pool.evict_ahead()  # safe beside a prefill in flight: its checkpoints are not filed yet
        self.scheduler.prepare_waiting()
        clock.overlap_ended()
        beside = 0
        if decode is not None and launched is not None:
            try:
                beside, beside_outputs = self._prefill_beside(prefill_lane, decode_lane, launched)
            except BaseException:  # the abort that follows frees this step's rows: admission waits for the step
                self._decode_tail = Fence.after(decode_lane)
                raise
            outputs += beside_outputs + self._finish_decode(decode_lane, decode, launched)
            if self._graphs_stale:  # the split changed while this step ran: its graphs from the next step on
                self._graphs_stale = False
                self._use_graphs()
        clock.execute_done()
        prefill_tokens, prefill_outputs = self._poll_prefill(wait=decode is None)
        prefill_tokens += beside
        outputs += prefill_outputs
        if not launched_prefill and decode is None and not prefill_tokens and self.in_flight is None:
            self.scheduler.unblock()  # every running request waits for pages the others hold
        self.engine.last_step = clock.timing(len(decode.decodes) if decode is not None else 0, prefill_tokens)
        return outputs

    def _whole_step(self, on_launched: Callable[[], None] | None) -> list[RequestOutput]:
        """The engine's co-located step on the whole GPU (its graphs, the loop's stream), after the lanes' queued
        work; the lanes' next launches wait for it (`Fence.loop_stream`)."""
        if not self.whole:
            self.whole = True
            self._use_graphs()
        for fence in (self._admitted, self._prefill_tail, self._decode_tail, self._beside_tail):
            if fence is not None:
                fence.hold_loop(self.runner.device)
        self._admitted = self._prefill_tail = self._decode_tail = self._beside_tail = None
        steps = self.engine.async_steps
        launched_before = steps.num_async_steps if steps is not None and steps.busy else None
        outputs = self.engine.colocated_step(on_launched)
        if steps is not None and launched_before == steps.num_async_steps:  # it only applied the step in flight,
            return outputs  # whose work was counted at its launch
        step, counters, total = self.engine.last_step, self.counters, self.partitioner.total_sms
        if step.decode_rows or step.prefill_tokens:
            counters.whole_gpu_steps += 1
            counters.prefill_tokens_by_sms[total] += step.prefill_tokens
            counters.decode_rows_by_sms[total] += step.decode_rows
        return outputs

    def _leave_whole(self) -> list[RequestOutput]:
        """Back in the lanes: a whole-GPU step still in flight (async scheduling) is applied, the lanes' graphs are
        taken; the outputs of that step."""
        try:
            return self.engine.async_steps.flush() if self.engine.async_steps is not None else []
        finally:
            self.whole = False
            self._use_graphs()

    def _launch_prefill(self, lane: Lane, decode_lane: Lane) -> bool:
        """Schedule a prefill-only batch and launch it on the prefill lane; False: no prompt could be scheduled."""
        scheduled = time.perf_counter()
        outside = Fence.loop_stream(lane)
        with lane:
            outside.hold(lane)
            if self._decode_tail is not None:  # kept until a launch: a whole-GPU step may need to wait for it too
                self._decode_tail.hold(lane)
            work = self.scheduler.schedule_prefill_lane()
            if work.is_empty:
                return False
            self._decode_tail = None
            self._admitted = Fence.after(lane)
            prefills = [(c.request, c.num_tokens) for c in work.prefills]
            checkpoint_slots = self.pool.plan_checkpoints(prefills)
            plan = self.pool.take_plan()
            tiny = self.runner.device.type == "cuda" and sum(c.num_tokens for c in work.prefills) <= SPLIT_K_ROWS
            if tiny:  # a forward this small may share split-K scratch with decode's: between two decode steps
                lane.wait_for(decode_lane)
            start = Fence.after(lane, timing=True)
            started = time.perf_counter()
            try:
                launched = self.runner.launch(work, checkpoint_slots)
            except BaseException:
                self.pool.put_plan(plan)
                self.pool.cancel_plan()
                raise
            done = Fence.after(lane, timing=True)
        if tiny:
            self._prefill_tail = done
        self.scheduler.hold(request for request, _ in prefills)
        self._prefill_launch_ms = (time.perf_counter() - scheduled) * 1e3
        self.in_flight = PrefillInFlight(work, launched, plan, self.split, lane, start, done, started,
                                         self.iteration + self.prefill_delay)
        return True

    def _prefill_beside(self, lane: Lane, decode_lane: Lane, decode: DecodeInFlight) -> tuple[int, list[RequestOutput]]:
        """Until the decode step completes: each prefill forward that completes is taken and, where the controller
        keeps the lanes and the split (a change waits for this step's end) and the step's predicted time left covers
        a prefill launch, the next one launched. -> (prefill tokens taken, requests updated). On a real lane the host polls
        every PREFILL_POLL_S, for at most twice the step's predicted time; on a fake lane the step is complete."""
        tokens = 0
        outputs: list[RequestOutput] = []
        if self.in_flight is None:  # nothing beside this step: no prediction to make
            return tokens, outputs
        real = decode.done.event is not None
        rows = len(decode.launched.work.decodes)
        predicted_s = self.controller.predict_ms("decode", decode.split.decode_sms, rows) / 1e3
        while self.in_flight is not None and not decode.done.done():
            elapsed_s = time.perf_counter() - decode.launched_at
            if real and elapsed_s > 2 * predicted_s + 5e-3:  # an event reading pending past its time: really wait
                break
            if not self.in_flight.done.done():
                time.sleep(PREFILL_POLL_S)
                continue
            done_tokens, done_outputs = self._poll_prefill(wait=False)
            if self.in_flight is not None:  # held back (a test's fake delay)
                break
            tokens, outputs = tokens + done_tokens, outputs + done_outputs
            self._beside_tail = self._prefill_tail
            load = self.scheduler.load()
            if self._whole_next(load):
                break  # a backlog to drain (or nothing left to prefill): the next step runs on the whole GPU
            if self._choose_split(load, use_graphs=False):
                self._graphs_stale = True
                break
            if real and (predicted_s - elapsed_s) * 1e3 < self._prefill_launch_ms:  # it would delay this step's tokens
                break
            if not self._launch_prefill(lane, decode_lane):
                break
            self.counters.prefills_beside_decode += 1
        return tokens, outputs

    def _schedule_decode(self, lane: Lane) -> SchedulerOutput | None:
        with lane:
            work = self.scheduler.schedule_decode_lane()
        return None if work.is_empty else work

    def _launch_decode(self, lane: Lane, work: SchedulerOutput) -> DecodeInFlight:
        outside = Fence.loop_stream(lane)
        with lane:
            outside.hold(lane)
            if self._prefill_tail is not None:
                self._prefill_tail.hold(lane)
                self._prefill_tail = None
            self.counters.overlapped_steps += self.in_flight is not None
            start, started = Fence.after(lane, timing=True), time.perf_counter()
            launched = self.runner.launch(work)
            return DecodeInFlight(launched, start, Fence.after(lane, timing=True), time.perf_counter() - started,
                                  self.split, started)

    def _finish_decode(self, lane: Lane, work: SchedulerOutput, decode: DecodeInFlight) -> list[RequestOutput]:
        with lane:
            output = self.runner.finish(decode.launched)
            if self._admitted is not None:  # the commit may evict a checkpoint the prefill's admission copies from
                self._admitted.hold(lane)
                self._admitted = None
            if self._beside_tail is not None:  # a prefill update taken while this step ran came first
                self._beside_tail.hold(lane)
                self._beside_tail = None
            gpu_ms = decode.done.ms_since(decode.start)  # the forward's own time, not the prefill's host work
            self.controller.record("decode", decode.split, len(work.decodes),
                                   gpu_ms if gpu_ms is not None else decode.launch_s * 1e3)
            self.counters.decode_rows_by_sms[decode.split.decode_sms] += len(work.decodes)
            outputs = self.update(work, output)
            self._decode_tail = Fence.after(lane)
        return outputs

    def _poll_prefill(self, wait: bool) -> tuple[int, list[RequestOutput]]:
        """The prefill forward's results once it completed (`wait`: wait for it): (its tokens, updated requests)."""
        flight = self.in_flight
        if flight is None or (not wait and (self.iteration < flight.ready_at or not flight.done.done())):
            return 0, []
        with flight.lane:
            try:
                output = self.runner.finish(flight.launched)
            except BaseException:
                self.pool.put_plan(flight.plan)
                self.pool.cancel_plan()
                raise
            finally:
                self.in_flight = None
                self.scheduler.release_held()
            self.pool.put_plan(flight.plan)
            outputs = self.update(flight.work, output)
            self._prefill_tail = Fence.after(lane=flight.lane)
        gpu_ms = flight.done.ms_since(flight.start)
        self.controller.record("prefill", flight.split, flight.tokens,
                               gpu_ms if gpu_ms is not None else (time.perf_counter() - flight.started) * 1e3)
        self.counters.prefill_tokens_by_sms[flight.split.prefill_sms] += flight.tokens
        self.counters.handoffs += sum(1 for c in flight.work.prefills if c.request.is_decoding and not c.request.finished)
        for request_id in flight.aborted:
            self.engine.abort(request_id)
        aborted = set(flight.aborted)
        return flight.tokens, [o for o in outputs if o.request_id not in aborted]

    def pin(self, split: SmSplit | None, then: SmSplit | None = None) -> None:
        """Hold `split` until unpinned (the start-up profile runs in each split); None: the controller chooses again,
        from `then` (default: the split in effect). Only while no forward is in flight (a lane's prefill, or a
        whole-GPU step ahead of its tokens)."""
        if self.in_flight is not None or self.engine.async_steps is not None and self.engine.async_steps.busy:
            raise RuntimeError("the split cannot change while a forward is in flight")
        self.controller.restart_from(split or then or self.split)  # ValueError off the menu, before any change
        self.pinned = split
        self._use_graphs()

    def _whole_next(self, load: tuple[int, int]) -> bool:
        """Whether the next step runs on the whole GPU, for `load` (LaneScheduler.load); never while pinned."""
        return self.pinned is None and self.controller.whole_gpu(*load)

    def _choose_split(self, load: tuple[int, int], use_graphs: bool = True) -> bool:
        """The split for the next prefill forward and the decode steps beside it, for `load` (LaneScheduler.load);
        True if it changed (`use_graphs`: the runner takes its graphs now; else the caller does, once no step uses
        the old)."""
        if self.pinned is not None:
            return False
        (waiting, decoding), before = load, self.split
        split = self.controller.choose(waiting, decoding)
        if split == before:
            return False
        # DEBUG: the split follows the phases (a prompt arriving, the queue emptying), a change or two per request
        logger.debug("pd_multiplex: SM split %s -> %s (%d prompt tokens waiting, %d decoding)", before, split,
                     waiting, decoding)
        if use_graphs:
            self._use_graphs()
        return True

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def capture_graphs(self, max_batch: int, max_pages: int, prefill_tokens: int, prefill: bool) -> None:
        """Decode (and, with `prefill`, prefill) graphs captured in the lanes of every split (engine/lane_graphs.py)
        and, where steps may run on the whole GPU, the co-located engine's."""
        if self.controller.policy.whole_gpu:
            self.runner.capture_graphs(max_batch, max_pages, prefill_tokens, prefill)
            self.whole_graphs = LaneGraphs(self.runner.decode_graphs, self.runner.prefill_graphs)
        self.graphs = capture_lane_graphs(self.runner, self.partitioner, max_batch, max_pages, prefill_tokens, prefill)
        self._use_graphs()

    def _use_graphs(self) -> None:
        """The runner replays the graphs captured for the split in effect (or for the whole GPU)."""
        graphs = self.whole_graphs if self.whole else self.graphs.get(self.split)
        if graphs is not None:
            self.runner.decode_graphs, self.runner.prefill_graphs = graphs.decode, graphs.prefill

    # ---- requests ---------------------------------------------------------------------------------
    def defer_abort(self, request_id: str) -> bool:
        """Whether the request's prefill forward is in flight: then its abort waits until the forward completed (its
        pages and slot are being written); True: deferred."""
        flight = self.in_flight
        if flight is None or all(c.request.request_id != request_id for c in flight.work.prefills):
            return False
        if request_id not in flight.aborted:
            flight.aborted.append(request_id)
        return True

    def stats(self) -> dict[str, Any]:
        """The split in effect, how often it changed, and what the steps ran (LaneCounters), for a worker's metrics."""
        return {"prefill_sms": self.split.prefill_sms, "decode_sms": self.split.decode_sms,
                "split_changes": self.controller.changes, **self.counters.as_stats()}
