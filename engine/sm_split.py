"""Which SM split prefill and decode run in: a cost model learned from the lanes' measured step times, with
hysteresis so that the split follows the load without flapping.

Model. Each lane's step time at an SM count is a line in its work (prefill: tokens in the step; decode: rows),
`ms = fixed + per_unit * work`, fitted by least squares over exponentially weighted sums of the samples `record`
gets (an EMA of x, y, x^2, xy: old steps fade). While one SM count has seen a single work size the line is
`ms * (work / seen) ** work_exponent` (prefill scales with its tokens, decode barely with its rows). An SM count with
no samples between two measured ones is interpolated in log-log (never rising with SMs where the measured times do
not); one outside them borrows the nearest measured one, scaled by `(measured_sms / sms) ** sm_exponent` (prefill is
compute-bound: ~1; decode is memory-bound and saturates bandwidth with fewer SMs: below 1); a lane with no samples
at all starts from the policy's priors (or a start-up profile).

Choice. For each split of the menu, with W prefill tokens waiting and B decode rows:
    decode_ms  = T_decode(split.decode_sms, B)              one decode step
    prefill_ms = T_prefill(split.prefill_sms, W)            time to prefill what waits
    budget     = tpot_slo_ms, or decode_slowdown x the fastest decode_ms of the menu; none while the backlog takes
                 longer than backlog_ms to prefill in the split that budget gives it (a deep queue: drain it)
    cost = prefill_ms * (1 + over_budget_weight * max(0, decode_ms / budget - 1))    (W and B both > 0)
    cost = decode_ms (W = 0: decode takes its fastest split), cost = prefill_ms (B = 0: prefill takes the largest)
i.e. the fastest prefill among the splits whose decode step stays within its budget. The default budget keeps the
running streams' inter-token tail (a step beside a prefill against one without) within decode_slowdown; a TPOT
service-level objective instead gives decode just the SMs that keep its step within the SLO and prefill the rest
(goodput). Hysteresis: the best split replaces the current one after winning by `switch_margin` (relative cost)
in `switch_after` consecutive decisions, or at once when it costs at most `switch_now_ratio` of the current one
(a prompt arriving while decode holds nearly every SM must not prefill on the few left for three decisions) or, when
nothing waits, by `idle_switch_margin` (the prefill lane is idle: its SMs go to decode at no cost). The budget
bounds a decode step's time; with speculative decoding a step emits more than one token, so a TPOT SLO there bounds
more than TPOT.

The whole GPU. A split pays for isolation: a prefill lane of k SMs runs up to 132/k times slower, and a decode step
in its lane reads every weight the prefill beside it reads too. So (policy.whole_gpu) lanes run only while both
phases have work and the queue is short; otherwise a step is the co-located engine's, one mixed batch on the whole
GPU: while one phase has no work, and from the moment what waits takes longer than backlog_ms to prefill in the
split the decode budget gives it until nothing waits (`draining`). A burst then drains at the whole GPU's prefill
speed, as co-located: the time to its last first token bounds its throughput, and the running streams' inter-token
tail, which the lanes would protect, is then worth less than a queue already past its TTFT objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from hybridserve.engine.sm_partition import LANES, SmSplit

PREDICTION_CACHE = 4096  # predict_ms answers kept between samples, at most


@dataclass(frozen=True)
class ProfilePoint:
    """One measured step of a start-up profile: `lane` ran `work` units (tokens or rows) on `sms` SMs in `ms`."""

    lane: str
    sms: int
    work: int
    ms: float

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"ProfilePoint.lane must be one of {LANES}, got {self.lane!r}")
        if self.sms <= 0 or self.work <= 0 or not (self.ms >= 0 and math.isfinite(self.ms)):
            raise ValueError(f"ProfilePoint needs sms > 0, work > 0 and a finite ms >= 0, got {self}")


@dataclass(frozen=True)
class SplitPolicy:
    """Knobs of the split controller (validated on construction)."""

    # a new split must cost at most (1 - switch_margin) x the current one's ...
    switch_margin: float = 0.15
    # ... in this many consecutive decisions before it replaces the current one
    switch_after: int = 3
    switch_now_ratio: float = 0.5  # a split costing at most this share of the current one's replaces it at once
    idle_switch_margin: float = 0.05  # with nothing waiting, a decode split this much faster replaces it at once
    ema_alpha: float = 0.2  # weight of the newest sample in a lane's fit
    # the decode step's budget while prompts wait: this many times the menu's fastest decode step ...
    decode_slowdown: float = 1.3
    tpot_slo_ms: float = 0.0  # ... or, when > 0, this many milliseconds (a TPOT service-level objective)
    # steps run co-located on the whole GPU (one mixed batch, no lanes) while one phase has no work (nothing to
    # isolate; a lane would leave SMs idle) and while a deep backlog drains (below)
    whole_gpu: bool = True
    # once what waits takes longer than this to prefill in the split the decode budget gives it, the queue's last
    # prompt would wait past a TTFT objective of this size and draining it is what throughput needs: with whole_gpu,
    # steps run on the whole GPU until the queue is empty (as a co-located engine drains a burst); without, the
    # decode budget is lifted and prefill takes the most SMs (0: neither)
    backlog_ms: float = 500.0
    over_budget_weight: float = 20.0  # a split 10 % over the decode budget costs 3x its prefill time
    # how a step's time grows with its work while only one work size was seen (1: proportional)
    prefill_work_exponent: float = 1.0
    decode_work_exponent: float = 0.2
    # how a step's time grows with fewer SMs where an SM count was not measured (1: inversely proportional). On an
    # H200 (bench/results/h200/multiplex/) prefill's GEMMs and scan follow ~1; decode's skinny GEMMs and state
    # update lose 1-28% at 64-68 of 132 SMs and 2.6-4.2x at 16: ~0.2 above half the GPU, ~0.5-0.7 below
    prefill_sm_exponent: float = 1.0
    decode_sm_exponent: float = 0.4
    # priors on the whole device until a lane is measured: ms per prefill token, ms per decode step (~a 9B
    # hybrid's on an H200: ~30K prefill tokens/s, ~8 ms per decode step at 64 rows)
    prior_prefill_ms_per_token: float = 0.035
    prior_decode_step_ms: float = 8.0
    prior_decode_rows: int = 64
    initial_prefill_fraction: float = 0.5  # the split closest to this share of the SMs for prefill starts
    profile: tuple[ProfilePoint, ...] = field(default=())  # start-up measurements that seed the model

    def __post_init__(self) -> None:
        if not 0.0 <= self.switch_margin < 1.0:
            raise ValueError(f"switch_margin must be in [0, 1), got {self.switch_margin}")
        if self.switch_after < 1:
            raise ValueError(f"switch_after must be >= 1, got {self.switch_after}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if not 0.0 <= self.idle_switch_margin < 1.0:
            raise ValueError(f"idle_switch_margin must be in [0, 1), got {self.idle_switch_margin}")
        if not 0.0 < self.switch_now_ratio <= 1.0:
            raise ValueError(f"switch_now_ratio must be in (0, 1], got {self.switch_now_ratio}")
        for name in ("prior_prefill_ms_per_token", "prior_decode_step_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.decode_slowdown >= 1.0:
            raise ValueError(f"decode_slowdown must be >= 1 (a multiple of the fastest decode step), got "
                             f"{self.decode_slowdown}")
        for name in ("tpot_slo_ms", "backlog_ms", "over_budget_weight", "prefill_work_exponent", "decode_work_exponent",
                     "prefill_sm_exponent", "decode_sm_exponent"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.whole_gpu, bool):
            raise ValueError(f"whole_gpu must be a bool, got {self.whole_gpu!r}")
        if self.prior_decode_rows < 1:
            raise ValueError(f"prior_decode_rows must be >= 1, got {self.prior_decode_rows}")
        if not 0.0 <= self.initial_prefill_fraction <= 1.0:
            raise ValueError(f"initial_prefill_fraction must be in [0, 1], got {self.initial_prefill_fraction}")
        if not all(isinstance(p, ProfilePoint) for p in self.profile):
            raise ValueError("profile must be a tuple of ProfilePoint")

    def work_exponent(self, lane: str) -> float:
        return self.prefill_work_exponent if lane == "prefill" else self.decode_work_exponent

    def sm_exponent(self, lane: str) -> float:
        return self.prefill_sm_exponent if lane == "prefill" else self.decode_sm_exponent


class _LineFit:
    """Exponentially weighted least squares of ms against work at one (lane, SM count)."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, work: float, ms: float, alpha: float) -> None:
        keep = 1.0 - alpha
        self.w = keep * self.w + alpha
        self.x = keep * self.x + alpha * work
        self.y = keep * self.y + alpha * ms
        self.xx = keep * self.xx + alpha * work * work
        self.xy = keep * self.xy + alpha * work * ms

    def predict(self, work: float, work_exponent: float) -> float:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var > (0.05 * mx) ** 2:  # two or more work sizes seen: the fitted line (never falling with work)
            slope = max(0.0, (self.xy / self.w - mx * my) / var)
            return max(0.0, my + slope * (work - mx))
        return my * (work / mx) ** work_exponent if mx > 0 else my


class SplitController:
    """Picks the split of the menu for the next steps (`choose`) from the lanes' measured times (`record`)."""

    def __init__(self, policy: SplitPolicy, splits: tuple[SmSplit, ...]) -> None:
        if not splits:
            raise ValueError("the split menu is empty")
        self.policy = policy
        self.splits = tuple(sorted(set(splits), key=lambda s: s.prefill_sms))
        total = max(s.prefill_sms + s.decode_sms for s in self.splits)
        self.total_sms = total
        target = policy.initial_prefill_fraction * total
        self.current: SmSplit = min(self.splits, key=lambda s: (abs(s.prefill_sms - target), s.prefill_sms))
        self.changes = 0  # times the split changed
        self.decisions = 0
        self.draining = False  # a backlog past backlog_ms is being drained on the whole GPU (policy.whole_gpu)
        self._fits: dict[tuple[str, int], _LineFit] = {}
        self._measured: dict[str, tuple[int, ...]] = {}  # lane -> the SM counts in _fits, ascending
        # predict_ms's answers since the last sample (a step's decisions ask the same ones several times)
        self._predicted: dict[tuple[str, int, int], float] = {}
        self._candidate: SmSplit | None = None
        self._streak = 0
        self.seed(policy.profile)

    def seed(self, points: Iterable[ProfilePoint]) -> None:
        """Start-up measurements (e.g. one decode step and one prefill chunk timed in each lane of the menu while
        the lanes' graphs are captured): weighted like half the history, so live steps soon take over."""
        for point in points:
            self._add(point.lane, point.sms, point.work, point.ms, alpha=0.5)

    def record(self, lane: str, split: SmSplit, work: int, ms: float) -> None:
        """One step of `lane` ran `work` units (prefill tokens or decode rows) on its SMs of `split` in `ms`.
        Steps with no work or a non-finite time are ignored."""
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        if work <= 0 or not (ms >= 0 and math.isfinite(ms)):
            return
        self._add(lane, split.sms(lane), work, ms, self.policy.ema_alpha)

    def _add(self, lane: str, sms: int, work: int, ms: float, alpha: float) -> None:
        self._predicted.clear()
        fit = self._fits.get((lane, sms))
        if fit is None:
            fit = self._fits[(lane, sms)] = _LineFit()
            self._measured[lane] = tuple(sorted((*self._measured.get(lane, ()), sms)))
            alpha = 1.0  # a first sample is the estimate
        fit.add(float(work), float(ms), alpha)

    def measured(self, lane: str) -> tuple[int, ...]:
        """The SM counts `lane` has times for (live steps or a profile), ascending."""
        return self._measured.get(lane, ())

    def predict_ms(self, lane: str, sms: int, work: int) -> float:
        """The model's time for `lane` to run `work` units on `sms` SMs (0 for no work)."""
        if work <= 0:
            return 0.0
        key = (lane, sms, work)
        ms = self._predicted.get(key)
        if ms is None:
            if len(self._predicted) >= PREDICTION_CACHE:  # no sample for long (whole-GPU steps record none)
                self._predicted.clear()
            ms = self._predicted[key] = self._predict_ms(lane, sms, work)
        return ms

    def _predict_ms(self, lane: str, sms: int, work: int) -> float:
        p = self.policy
        measured = self.measured(lane)
        if not measured:
            if lane == "prefill":
                base = p.prior_prefill_ms_per_token * work
            else:
                base = p.prior_decode_step_ms * (work / p.prior_decode_rows) ** p.decode_work_exponent
            return base * (self.total_sms / sms) ** p.sm_exponent(lane)
        below = [s for s in measured if s <= sms]
        above = [s for s in measured if s >= sms]
        if below and above:  # between two measured counts (or on one): log-log interpolation, exact at both ends
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self._measured_ms(lane, lo, work), self._measured_ms(lane, hi, work)
            if lo == hi or t_lo <= 0 or t_hi <= 0:
                return t_lo if sms - lo <= hi - sms else t_hi
            w = math.log(sms / lo) / math.log(hi / lo)
            return t_lo ** (1.0 - w) * t_hi ** w
        near = above[0] if above else below[-1]  # outside the measured counts: the nearest, scaled
        return self._measured_ms(lane, near, work) * (near / sms) ** p.sm_exponent(lane)

    def _measured_ms(self, lane: str, sms: int, work: int) -> float:
        return self._fits[(lane, sms)].predict(float(work), self.policy.work_exponent(lane))

    def describe(self, decode_rows: int, prefill_tokens: int) -> str:
        """Each split's predicted decode step of `decode_rows` and prefill of `prefill_tokens`, for the log."""
        return ", ".join(f"{s} {self.predict_ms('decode', s.decode_sms, decode_rows):.2f} / "
                         f"{self.predict_ms('prefill', s.prefill_sms, prefill_tokens):.1f} ms" for s in self.splits)

    def backlog_deep(self, prefill_tokens_waiting: int, decode_rows: int) -> bool:
        """Whether what waits takes longer than backlog_ms to prefill in the split the decode budget gives it (with
        nothing decoding: the largest prefill lane), i.e. the queue's last prompt would wait past backlog_ms."""
        backlog_ms = self.policy.backlog_ms
        if backlog_ms <= 0 or prefill_tokens_waiting <= 0:
            return False
        budget = self._objective_budget_ms(decode_rows) if decode_rows > 0 else None
        split = self.best(prefill_tokens_waiting, decode_rows, budget)
        return self.predict_ms("prefill", split.prefill_sms, prefill_tokens_waiting) > backlog_ms

    def whole_gpu(self, prefill_tokens_waiting: int, decode_rows: int) -> bool:
        """Whether the next step runs co-located on the whole GPU (policy.whole_gpu): while one phase has no work,
        and from a backlog deeper than backlog_ms until nothing waits (a burst drained at the whole GPU's speed)."""
        if not self.policy.whole_gpu:
            return False
        if prefill_tokens_waiting <= 0:
            self.draining = False
            return True
        self.draining = self.draining or self.backlog_deep(prefill_tokens_waiting, decode_rows)
        return self.draining or decode_rows <= 0

    def decode_budget_ms(self, decode_rows: int, prefill_tokens_waiting: int = 0) -> float:
        """The decode step's budget while prompts wait (module docstring); unbounded while the backlog is deep."""
        if self.backlog_deep(prefill_tokens_waiting, decode_rows):
            return math.inf
        return self._objective_budget_ms(decode_rows)

    def _objective_budget_ms(self, decode_rows: int) -> float:
        """The budget of the policy's objective: the TPOT SLO, else decode_slowdown x the fastest decode step."""
        p = self.policy
        if p.tpot_slo_ms > 0:
            return p.tpot_slo_ms
        return p.decode_slowdown * min(self.predict_ms("decode", s.decode_sms, decode_rows) for s in self.splits)

    def _budget(self, prefill_tokens_waiting: int, decode_rows: int) -> float | None:
        """The decode budget of a load where it applies (prompts waiting beside decode rows), else None."""
        if decode_rows > 0 and prefill_tokens_waiting > 0:
            return self.decode_budget_ms(decode_rows, prefill_tokens_waiting)
        return None

    def cost(self, split: SmSplit, prefill_tokens_waiting: int, decode_rows: int,
             budget_ms: float | None = None) -> float:
        """The objective `choose` minimizes (module docstring); `budget_ms`: the decode budget, when known."""
        decode_ms = self.predict_ms("decode", split.decode_sms, decode_rows)
        if prefill_tokens_waiting <= 0:
            return decode_ms
        prefill_ms = self.predict_ms("prefill", split.prefill_sms, prefill_tokens_waiting)
        if decode_rows <= 0:
            return prefill_ms
        budget = budget_ms if budget_ms is not None else self.decode_budget_ms(decode_rows, prefill_tokens_waiting)
        over = max(0.0, decode_ms / budget - 1.0) if 0 < budget < math.inf else 0.0
        # a fitted line may reach 0 ms for a small backlog: a floor keeps the budget's penalty from vanishing
        return max(prefill_ms, 1e-3) * (1.0 + self.policy.over_budget_weight * over)

    def best(self, prefill_tokens_waiting: int, decode_rows: int, budget_ms: float | None = None) -> SmSplit:
        """The split of least cost for this load, without hysteresis (ties: the current one, then fewer prefill SMs)."""
        if budget_ms is None:
            budget_ms = self._budget(prefill_tokens_waiting, decode_rows)
        return min(self.splits, key=lambda s: (self.cost(s, prefill_tokens_waiting, decode_rows, budget_ms),
                                               s != self.current, s.prefill_sms))

    def choose(self, prefill_tokens_waiting: int, decode_rows: int) -> SmSplit:
        """The split for the next step: the current one unless another has won by the margin `switch_after` times in
        a row, or by `switch_now_ratio` once."""
        if prefill_tokens_waiting < 0 or decode_rows < 0:
            raise ValueError(f"load must be >= 0, got {prefill_tokens_waiting} tokens, {decode_rows} rows")
        self.decisions += 1
        budget = self._budget(prefill_tokens_waiting, decode_rows)
        best = self.best(prefill_tokens_waiting, decode_rows, budget)
        if best == self.current:
            self._candidate, self._streak = None, 0
            return self.current
        now = self.cost(self.current, prefill_tokens_waiting, decode_rows, budget)
        new = self.cost(best, prefill_tokens_waiting, decode_rows, budget)
        # nothing waits: the prefill lane is idle, so giving decode its SMs costs nothing and is done at once (past a
        # small margin, so that near-equal decode splits do not alternate with the noise of their measured times)
        idle = prefill_tokens_waiting == 0 and new < (1.0 - self.policy.idle_switch_margin) * now
        if idle or new <= self.policy.switch_now_ratio * now:
            self._switch(best)
            return self.current
        if not new < (1.0 - self.policy.switch_margin) * now:
            self._candidate, self._streak = None, 0
            return self.current
        self._streak = self._streak + 1 if best == self._candidate else 1
        self._candidate = best
        if self._streak >= self.policy.switch_after:
            self._switch(best)
        return self.current

    def restart_from(self, split: SmSplit) -> None:
        """Make `split` the current one without counting a change (a pinned split, or the profile's end); the fits
        learned so far stay."""
        if split not in self.splits:
            raise ValueError(f"{split} is not on the menu: pin one of {self.splits}")
        self.current = split
        self._candidate, self._streak = None, 0

    def forget(self) -> None:
        """Drop every measured time and the change counts (before a start-up profile: the warm-up's steps include
        kernel compiles, seconds each, that would make the splits it ran in look slow)."""
        self._fits.clear()
        self._measured.clear()
        self._predicted.clear()
        self.changes = self.decisions = 0
        self.draining = False
        self._candidate, self._streak = None, 0
        self.seed(self.policy.profile)

    def _switch(self, split: SmSplit) -> None:
        self.current, self.changes = split, self.changes + 1
        self._candidate, self._streak = None, 0
