"""SM partitions: the menu arithmetic, the fake lanes CPU tests run on, and the clear refusal where green contexts
cannot be made."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridserve.engine.sm_partition import (
    PartitionUnavailable,
    SmSplit,
    active_lane,
    fake_partitioner,
    open_partitioner,
    plan_splits,
)


def test_menu_rounds_to_the_granularity_and_gives_decode_the_rest() -> None:
    splits = plan_splits(132, 8, (20, 16, 64, 17, 112, 4))
    assert splits == (SmSplit(16, 116), SmSplit(24, 108), SmSplit(64, 68), SmSplit(112, 20))
    assert all(s.prefill_sms % 8 == 0 and s.prefill_sms + s.decode_sms == 132 for s in splits)
    # a measurement may ask for one-group lanes, which serving refuses
    assert plan_splits(132, 8, (4, 120), min_lane_groups=1) == (SmSplit(8, 124), SmSplit(120, 12))
    with pytest.raises(ValueError, match="min_lane_groups"):
        plan_splits(132, 8, (16,), min_lane_groups=0)


@pytest.mark.parametrize("menu", [(), (0,), (-8,), (120,), (128,), (132,), (True,)])
def test_bad_menus_are_refused_with_what_to_change(menu: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="menu|positive|decode"):
        plan_splits(132, 8, menu)


def test_split_is_validated_and_names_its_lanes() -> None:
    split = SmSplit(32, 100)
    assert (split.sms("prefill"), split.sms("decode"), str(split)) == (32, 100, "32P/100D")
    with pytest.raises(ValueError):
        split.sms("both")
    with pytest.raises(ValueError):
        SmSplit(0, 132)


def test_fake_lanes_are_disjoint_and_record_which_lane_is_active() -> None:
    part = fake_partitioner(132, (32, 64))
    assert part.fake and part.total_sms == 132 and part.splits == (SmSplit(32, 100), SmSplit(64, 68))
    prefill, decode = part.lanes(SmSplit(64, 68))
    assert (prefill.name, prefill.sm_count, decode.name, decode.sm_count) == ("prefill", 64, "decode", 68)
    assert prefill.stream is None and active_lane() is None
    with prefill:
        assert active_lane() is prefill
        with decode as entered:
            assert entered is decode and active_lane() is decode
        assert active_lane() is prefill
    assert active_lane() is None
    decode.wait_for(prefill)  # no streams: nothing to order
    decode.synchronize()
    with pytest.raises(RuntimeError, match="fake lane"):
        decode.graph(None)  # type: ignore[arg-type]
    assert part.nearest(50) == SmSplit(64, 68) and part.nearest(0) == SmSplit(32, 100)
    with pytest.raises(ValueError, match="not in this partitioner's menu"):
        part.lanes(SmSplit(40, 92))


def test_active_lane_is_per_thread() -> None:
    prefill, decode = fake_partitioner(132, (32,)).lanes(SmSplit(32, 100))
    seen: list[object] = []
    with prefill:
        def other() -> None:
            with decode:
                seen.append(active_lane())
            seen.append(active_lane())
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert active_lane() is prefill
    assert seen == [decode, None]


def test_open_partitioner_refuses_without_cuda_in_one_line() -> None:
    with pytest.raises(PartitionUnavailable, match="CUDA device") as info:
        open_partitioner(torch.device("cpu"), (32,))
    assert "\n" not in str(info.value)
    if not torch.cuda.is_available():
        with pytest.raises(PartitionUnavailable, match="not available"):
            open_partitioner(torch.device("cuda"), (32,))


def test_open_partitioner_refuses_a_menu_the_device_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """A menu entry past what leaves decode two groups is the user's to change (ValueError at start-up); a device
    too small to split at all makes the mode unavailable (the engine runs co-located)."""
    from hybridserve.engine import sm_partition

    class Driver:
        granularity = 8

        def __init__(self, total_sms: int) -> None:
            self.total_sms = total_sms

        def split(self, prefill_sms: int):  # noqa: ANN201 - never reached: the menu is refused first
            raise AssertionError("split before the menu was checked")

    monkeypatch.setattr(sm_partition.GreenContextDriver, "open", staticmethod(lambda device: Driver(132)))
    with pytest.raises(ValueError, match="use at most 112"):
        open_partitioner(torch.device("cuda"), (32, 120))
    monkeypatch.setattr(sm_partition.GreenContextDriver, "open", staticmethod(lambda device: Driver(24)))
    with pytest.raises(PartitionUnavailable, match="24 SMs cannot hold two partitions of 16"):
        open_partitioner(torch.device("cuda"), (8,))
