"""The router's per-decode-worker seat queue: FIFO wake-ups, a refused waiter keeps its place, freed seats
nobody waited for are not lost, an abort ends the wait."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve.router.seat_queue import MAX_CREDIT, SeatQueue


def run(coro):  # noqa: ANN001, ANN201 - a test helper
    return asyncio.run(coro)


def test_a_freed_seat_wakes_the_oldest_waiter_first() -> None:
    async def main() -> list[str]:
        queue = SeatQueue(poll_s=30.0, idle_poll_s=30.0)
        woken: list[str] = []

        async def waiter(name: str) -> None:
            await queue.wait()
            woken.append(name)

        tasks = [asyncio.create_task(waiter(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)
        assert len(queue) == 3
        for _ in range(3):
            queue.seat_freed()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return woken

    assert run(main()) == ["a", "b", "c"]


def test_a_refused_waiter_goes_back_to_the_head_of_the_line() -> None:
    async def main() -> list[str]:
        queue = SeatQueue(poll_s=30.0, idle_poll_s=30.0)
        woken: list[str] = []

        async def waiter(name: str, again: bool) -> None:
            await queue.wait(again=again)
            woken.append(name)

        late = asyncio.create_task(waiter("newcomer", False))
        await asyncio.sleep(0)
        refused = asyncio.create_task(waiter("refused-before", True))
        await asyncio.sleep(0)
        queue.seat_freed()
        await asyncio.sleep(0.01)
        queue.seat_freed()
        await asyncio.gather(late, refused)
        return woken

    assert run(main()) == ["refused-before", "newcomer"]


def test_seats_freed_while_nobody_waited_let_the_next_waiters_ask_at_once() -> None:
    async def main() -> None:
        queue = SeatQueue(poll_s=30.0, idle_poll_s=30.0)
        for _ in range(MAX_CREDIT + 5):
            queue.seat_freed()
        for _ in range(MAX_CREDIT):  # each returns at once (a 30 s poll would hang the test)
            await asyncio.wait_for(queue.wait(), 1.0)
        with pytest.raises(asyncio.TimeoutError):  # the credit is bounded
            await asyncio.wait_for(queue.wait(), 0.05)
        assert len(queue) == 0

    run(main())


def test_a_wait_ends_on_abort_or_a_wake_up_and_says_whether_it_left_from_the_head() -> None:
    async def main() -> None:
        queue = SeatQueue(poll_s=30.0, idle_poll_s=30.0)
        cancelled = asyncio.Event()
        task = asyncio.create_task(queue.wait(cancelled=cancelled))
        await asyncio.sleep(0)
        cancelled.set()
        assert await asyncio.wait_for(task, 1.0) is False
        assert len(queue) == 0
        woken = asyncio.create_task(queue.wait())
        await asyncio.sleep(0)
        queue.seat_freed()
        assert await asyncio.wait_for(woken, 1.0) is True

    run(main())


def test_only_the_head_of_the_line_polls_often() -> None:
    """The head re-asks every poll_s (True: it keeps the head when refused); the others wait for a wake-up or
    idle_poll_s, so a long line does not flood the worker with Reserves."""
    async def main() -> None:
        queue = SeatQueue(poll_s=0.02, idle_poll_s=30.0)
        assert await asyncio.wait_for(queue.wait(), 1.0) is True  # alone, so the head: its poll
        blocker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue._waiters.append(blocker)  # a head that stays in line
        behind = asyncio.create_task(queue.wait())
        await asyncio.sleep(0.15)  # several poll intervals
        assert not behind.done()
        queue.seat_freed()  # wakes the blocker
        queue.seat_freed()  # then the one behind it
        assert await asyncio.wait_for(behind, 1.0) is True
        idle = SeatQueue(poll_s=0.01, idle_poll_s=0.05)
        idle._waiters.append(asyncio.get_running_loop().create_future())
        assert await asyncio.wait_for(idle.wait(), 1.0) is False  # not the head: gives up after idle_poll_s

    run(main())


def test_a_bad_poll_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        SeatQueue(poll_s=0)
    with pytest.raises(ValueError, match="idle_poll_s"):
        SeatQueue(poll_s=1.0, idle_poll_s=0.5)
