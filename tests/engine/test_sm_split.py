"""The split controller under synthetic loads and under the H200's measured per-SM times: it learns the lanes'
times, gives prefill every SM the decode budget leaves, switches at once when a prompt arrives, and does not flap."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.engine.sm_partition import SmSplit, fake_partitioner
from hybridserve.engine.sm_split import ProfilePoint, SplitController, SplitPolicy

SPLITS = fake_partitioner(132, (16, 32, 48, 64, 80, 96, 112)).splits


def synthetic_ms(lane: str, sms: int, work: int) -> float:
    """A made-up GPU: prefill compute-bound (0.03 ms/token on 132 SMs), decode a 6 ms step on 132 SMs that
    saturates bandwidth at ~64 SMs."""
    if lane == "prefill":
        return 2.0 + 0.03 * work * 132 / sms
    return (6.0 + 0.02 * work) * max(1.0, 64 / sms)


def run(controller: SplitController, load: tuple[int, int], steps: int) -> list[SmSplit]:
    chosen = []
    for _ in range(steps):
        split = controller.choose(*load)
        waiting, rows = load
        if rows:
            controller.record("decode", split, rows, synthetic_ms("decode", split.decode_sms, rows))
        if waiting:
            chunk = min(waiting, 2048)
            controller.record("prefill", split, chunk, synthetic_ms("prefill", split.prefill_sms, chunk))
        chosen.append(split)
    return chosen


def test_policy_is_validated() -> None:
    for bad in ({"switch_margin": 1.0}, {"switch_after": 0}, {"ema_alpha": 0.0}, {"decode_slowdown": 0.9},
                {"tpot_slo_ms": -1.0}, {"switch_now_ratio": 0.0}, {"backlog_ms": float("nan")},
                {"idle_switch_margin": 1.0},
                {"decode_sm_exponent": -1}, {"initial_prefill_fraction": 2.0}, {"profile": ("x",)}):
        with pytest.raises(ValueError):
            SplitPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ProfilePoint("both", 64, 10, 1.0)
    with pytest.raises(ValueError):
        SplitController(SplitPolicy(), ())


def test_decode_only_load_moves_to_the_smallest_prefill_lane_at_once() -> None:
    """Nothing waits: the prefill lane is idle, so its SMs go to decode without a streak."""
    c = SplitController(SplitPolicy(switch_after=3), SPLITS)
    assert c.current == SmSplit(64, 68)
    assert run(c, (0, 64), 3) == [SmSplit(16, 116)] * 3 and c.changes == 1
    # a decode split only a little faster (the noise of two near-equal splits) does not move it at once
    near = SplitController(SplitPolicy(switch_after=3), SPLITS)
    near.record("decode", SmSplit(64, 68), 64, 10.0)
    near.record("decode", SmSplit(16, 116), 64, 9.8)
    assert near.choose(0, 64) == SmSplit(64, 68) and near.changes == 0


def test_prefill_backlog_takes_every_sm_the_decode_budget_leaves() -> None:
    c = SplitController(SplitPolicy(switch_after=2), SPLITS)
    run(c, (0, 32), 10)
    assert c.current == SmSplit(16, 116)
    run(c, (6_000, 32), 30)  # ~0.3-0.4 s of prefill in the lane the budget gives: below the 0.5 s that lifts the budget
    # this GPU's decode saturates at 64 SMs: 52 SMs cost 1.23x its fastest step (within 1.3x), 36 SMs 1.78x
    assert c.current == SmSplit(80, 52)
    run(c, (60_000, 32), 10)  # ~3 s in that lane: a deep queue, drained on the most SMs
    assert c.current == SPLITS[-1]
    # the queue gone, decode gets back the SMs it is fast with
    run(c, (0, 32), 10)
    assert c.current.decode_sms >= 64
    assert c.changes >= 3


def test_a_prompt_arriving_beside_decode_switches_at_once() -> None:
    """Decode holds 116 SMs; a prompt arrives: its prefill must not run on 16 SMs while a streak builds up."""
    c = SplitController(SplitPolicy(switch_after=3), SPLITS)
    run(c, (0, 32), 5)
    assert c.current == SmSplit(16, 116)
    assert c.choose(2048, 32).prefill_sms >= 64  # the first decision, not the third
    prefill_only = SplitController(SplitPolicy(switch_after=3), SPLITS)
    run(prefill_only, (0, 32), 5)
    assert prefill_only.choose(8192, 0) == SPLITS[-1]  # nothing decodes now: the most prefill SMs, at once


def test_a_tpot_slo_gives_decode_just_the_sms_that_meet_it() -> None:
    profile = tuple(ProfilePoint("decode", s, 64, synthetic_ms("decode", s, 64)) for s in (20, 36, 52, 116)) + tuple(
        ProfilePoint("prefill", s, 2048, synthetic_ms("prefill", s, 2048)) for s in (16, 64, 112))
    for slo_ms, expected in ((0.0, SmSplit(80, 52)), (20.0, SmSplit(96, 36)), (100.0, SmSplit(112, 20))):
        c = SplitController(SplitPolicy(profile=profile, switch_after=1, tpot_slo_ms=slo_ms), SPLITS)
        assert c.choose(8192, 64) == expected, slo_ms  # decode at 36 SMs: 13 ms; at 20 SMs: 23 ms


def test_a_load_on_the_edge_does_not_flap() -> None:
    """Two loads whose best splits differ by less than the margin, alternating: the split stays put."""
    c = SplitController(SplitPolicy(switch_after=3, switch_margin=0.15), SPLITS)
    run(c, (2048, 32), 20)
    settled, changes = c.current, c.changes
    for i in range(40):
        load = (2048, 32) if i % 2 else (2600, 32)
        c.choose(*load)
    assert c.current == settled and c.changes == changes


def test_alternating_winners_never_complete_a_streak() -> None:
    # a TPOT budget that 68 decode SMs miss and 84 meet (priors: 10.4 and 9.6 ms at 64 rows)
    c = SplitController(SplitPolicy(switch_after=2, switch_margin=0.0, switch_now_ratio=0.3, tpot_slo_ms=9.7), SPLITS)
    start = c.current
    assert c.best(100_000, 0) == SmSplit(112, 20) and c.best(3000, 64) == SmSplit(48, 84)
    for i in range(20):  # a prompt backlog with nothing decoding, then one beside 64 rows: opposite winners
        c.choose(*((3000, 64) if i % 2 else (100_000, 0)))
    assert c.current == start and c.changes == 0


def test_learned_times_override_the_priors_and_unmeasured_sms_are_scaled() -> None:
    c = SplitController(SplitPolicy(ema_alpha=0.5), SPLITS)
    split = SmSplit(64, 68)
    for work in (512, 1024, 2048, 1024):
        c.record("prefill", split, work, synthetic_ms("prefill", 64, work))
    assert c.predict_ms("prefill", 64, 1536) == pytest.approx(synthetic_ms("prefill", 64, 1536), rel=0.01)
    # 32 SMs unmeasured: the nearest measured count, scaled by (64/32)^1
    assert c.predict_ms("prefill", 32, 1536) == pytest.approx(2 * c.predict_ms("prefill", 64, 1536))
    # one work size only: proportional for prefill by default
    c.record("decode", split, 32, 10.0)
    assert c.predict_ms("decode", 68, 32) == pytest.approx(10.0)
    assert c.predict_ms("decode", 68, 0) == 0.0
    c.record("decode", split, 0, 99.0)  # no work: ignored
    c.record("decode", split, 16, float("nan"))
    assert c.predict_ms("decode", 68, 32) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        c.record("mixed", split, 1, 1.0)
    with pytest.raises(ValueError):
        c.choose(-1, 0)


def test_seed_after_construction_matches_the_policy_profile() -> None:
    points = (ProfilePoint("decode", 68, 64, 9.0), ProfilePoint("prefill", 64, 2048, 120.0))
    late = SplitController(SplitPolicy(), SPLITS)
    late.seed(points)
    early = SplitController(SplitPolicy(profile=points), SPLITS)
    for lane, sms, work in (("decode", 68, 64), ("prefill", 64, 2048), ("prefill", 32, 1024)):
        assert late.predict_ms(lane, sms, work) == pytest.approx(early.predict_ms(lane, sms, work))


def test_a_startup_profile_seeds_the_model() -> None:
    profile = tuple(ProfilePoint("decode", s, 64, synthetic_ms("decode", s, 64)) for s in (20, 52, 116)) + tuple(
        ProfilePoint("prefill", s, 2048, synthetic_ms("prefill", s, 2048)) for s in (16, 64, 112))
    c = SplitController(SplitPolicy(profile=profile, switch_after=1), SPLITS)
    assert c.predict_ms("decode", 116, 64) == pytest.approx(synthetic_ms("decode", 116, 64))
    # decode saturates at 64 SMs, so with a moderate queue the controller gives prefill all but ~64 SMs
    c.choose(3000, 64)
    assert c.current.decode_sms >= 52 and c.current.prefill_sms >= 48


# The H200's per-SM-count times (bench/results/h200/multiplex/README.md, Nano-9B-v2 shapes), ms: a decode-like step
# (four 64x4480x15680 GEMMs and the 64-row state update) and a prefill-like one (the 4x2048-token SSD scan and an
# 8192^3 GEMM), both measured in green-context lanes of k SMs
H200_DECODE_MS = {124: 0.335, 116: 0.361, 100: 0.360, 68: 0.386, 64: 0.394, 36: 0.594, 32: 0.635, 16: 1.158,
                  12: 1.529}
H200_PREFILL_MS = {124: 2.379, 116: 2.541, 100: 2.933, 68: 4.126, 64: 4.215, 36: 6.939, 32: 7.774, 16: 15.40,
                   12: 20.46}


def test_on_the_h200_times_prefill_gets_what_the_decode_tail_allows() -> None:
    """Seeded with the measured table, the default budget (decode within 1.3x of its fastest split) gives prefill 72
    of 132 SMs; a looser TPOT budget gives it 104, and nothing decoding gives it 112."""
    splits = fake_partitioner(132, (16, 33, 49, 66, 82, 99, 112)).splits
    profile = tuple(ProfilePoint("decode", k, 64, ms) for k, ms in H200_DECODE_MS.items()) + tuple(
        ProfilePoint("prefill", k, 8192, ms) for k, ms in H200_PREFILL_MS.items())
    for policy, rows, expected in ((SplitPolicy(profile=profile, switch_after=1), 64, SmSplit(72, 60)),
                                   (SplitPolicy(profile=profile, switch_after=1, tpot_slo_ms=0.9), 64, SmSplit(104, 28)),
                                   (SplitPolicy(profile=profile, switch_after=1), 0, SmSplit(112, 20))):
        c = SplitController(policy, splits)
        assert c.choose(8192, rows) == expected
    described = SplitController(SplitPolicy(profile=profile), splits).describe(64, 8192)
    assert described.startswith("16P/116D 0.36 / 15.4 ms, ") and described.endswith("112P/20D 0.95 / 2.6 ms")


@settings(max_examples=60, deadline=None)
@given(decode=st.lists(st.floats(0.1, 50.0), min_size=7, max_size=7),
       prefill=st.lists(st.floats(0.1, 500.0), min_size=7, max_size=7),
       loads=st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 512)), min_size=1, max_size=30),
       slo=st.sampled_from([0.0, 5.0, 40.0]))
def test_invariants_under_random_times_and_loads(decode: list[float], prefill: list[float],
                                                 loads: list[tuple[int, int]], slo: float) -> None:
    """Whatever the measured times (monotone in the SMs, as a GPU's are) and the loads: predictions never rise with
    more SMs, every choice is on the menu, and with nothing waiting decode runs in (nearly) its fastest split."""
    c = SplitController(SplitPolicy(tpot_slo_ms=slo), SPLITS)
    decode_ms = sorted(decode, reverse=True)  # ascending decode SMs: falling times
    prefill_ms = sorted(prefill, reverse=True)  # ascending prefill SMs: falling times
    for split, ms in zip(sorted(SPLITS, key=lambda s: s.decode_sms), decode_ms):
        c.record("decode", split, 32, ms)
    for split, ms in zip(SPLITS, prefill_ms):
        c.record("prefill", split, 2048, ms)
    for lane in ("prefill", "decode"):
        times = [c.predict_ms(lane, sms, 1000) for sms in range(8, 133, 4)]
        assert all(a >= b - 1e-9 for a, b in zip(times, times[1:])), lane
    for waiting, rows in loads:
        split = c.choose(waiting, rows)
        assert split in SPLITS
        if waiting == 0 and rows > 0:
            fastest = min(c.predict_ms("decode", s.decode_sms, rows) for s in SPLITS)
            # within the idle margin of it (a split only that much faster does not replace the current one)
            assert c.predict_ms("decode", split.decode_sms, rows) <= fastest / (1 - c.policy.idle_switch_margin) + 1e-9


def test_the_split_follows_arrivals_and_an_emptied_queue_and_forget_starts_over() -> None:
    """On the H200's times a prompt arriving takes 72 prefill SMs and the queue emptying gives decode 116 again, at
    once each time: the phases change, not a near-tie (each switch is free: every split's graphs are captured)."""
    profile = tuple(ProfilePoint("decode", k, 64, ms) for k, ms in H200_DECODE_MS.items()) + tuple(
        ProfilePoint("prefill", k, 8192, ms) for k, ms in H200_PREFILL_MS.items())
    c = SplitController(SplitPolicy(profile=profile), fake_partitioner(132, (16, 33, 49, 66, 82, 99, 112)).splits)
    chosen = [c.choose(*((2048, 64) if i % 2 else (0, 64))) for i in range(6)]
    assert chosen == [SmSplit(16, 116), SmSplit(72, 60)] * 3 and c.changes == 6
    c.record("decode", SmSplit(16, 116), 64, 500.0)  # a warm-up step that compiled kernels
    c.forget()
    assert c.changes == 0 and c.decisions == 0
    assert c.predict_ms("decode", 116, 64) == pytest.approx(H200_DECODE_MS[116])  # back to the policy's profile


def test_whole_gpu_while_one_phase_idles_and_while_a_deep_backlog_drains() -> None:
    """The whole GPU while a phase has no work; a backlog past backlog_ms drains on it until nothing waits, whatever
    it shrinks to meanwhile; a short queue beside decode rows runs in the lanes; never with whole_gpu off."""
    controller = SplitController(SplitPolicy(backlog_ms=500.0), SPLITS)
    run(controller, (8192, 32), 6)  # measured: ~0.03 ms/token in the 112-SM lane, so 500 ms is ~16K tokens
    assert controller.whole_gpu(0, 32) and controller.whole_gpu(4096, 0) and controller.whole_gpu(0, 0)
    assert not controller.whole_gpu(4096, 32) and not controller.draining  # a short queue: the lanes
    assert controller.whole_gpu(65536, 32) and controller.draining  # deep: drained on the whole GPU ...
    assert controller.whole_gpu(2048, 32) and controller.draining  # ... until nothing waits
    assert controller.whole_gpu(0, 32) and not controller.draining
    assert not controller.whole_gpu(2048, 32)
    assert controller.whole_gpu(65536, 32)
    controller.forget()
    assert not controller.draining
    off = SplitController(SplitPolicy(whole_gpu=False, backlog_ms=500.0), SPLITS)
    assert not any(off.whole_gpu(w, b) for w, b in ((0, 32), (4096, 0), (65536, 32), (0, 0)))
    assert not off.draining
    with pytest.raises(ValueError, match="whole_gpu"):
        SplitPolicy(whole_gpu=1)  # type: ignore[arg-type]
