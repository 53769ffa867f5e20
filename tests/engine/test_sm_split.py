"""The split controller under synthetic loads: it learns the lanes' times, picks the split the cost model says,
and does not flap."""

from __future__ import annotations

import pytest

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
    for bad in ({"switch_margin": 1.0}, {"switch_after": 0}, {"ema_alpha": 0.0}, {"prefill_drain_ms": 0},
                {"decode_sm_exponent": -1}, {"initial_prefill_fraction": 2.0}, {"profile": ("x",)}):
        with pytest.raises(ValueError):
            SplitPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ProfilePoint("both", 64, 10, 1.0)
    with pytest.raises(ValueError):
        SplitController(SplitPolicy(), ())


def test_decode_only_load_moves_to_the_smallest_prefill_lane_after_the_streak() -> None:
    c = SplitController(SplitPolicy(switch_after=3), SPLITS)
    start = c.current
    assert start == SmSplit(64, 68)
    chosen = run(c, (0, 64), 5)
    assert chosen[:2] == [start, start]  # two wins are not enough
    assert chosen[2:] == [SmSplit(16, 116)] * 3 and c.changes == 1


def test_prefill_backlog_takes_sms_while_decode_keeps_what_keeps_it_fast() -> None:
    c = SplitController(SplitPolicy(switch_after=2), SPLITS)
    run(c, (0, 32), 10)
    assert c.current == SmSplit(16, 116)
    run(c, (40_000, 32), 30)  # far more than 16 SMs drain in 250 ms
    assert c.current.prefill_sms >= 64
    # the queue gone, decode gets back the SMs it is fast with (this GPU's decode saturates at 64)
    run(c, (0, 32), 10)
    assert c.current.decode_sms >= 64
    assert c.changes >= 2


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
    c = SplitController(SplitPolicy(switch_after=2, switch_margin=0.0), SPLITS)
    start = c.current
    for i in range(20):  # a decode-only step, then a huge prefill backlog with no decode: opposite ends
        c.choose(*((0, 64) if i % 2 else (100_000, 0)))
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
