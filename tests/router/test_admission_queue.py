"""Admission that queues: waiters get in strictly in arrival order, with no deadline of the router's own; the
running limit follows what the decode workers report; a waiter whose client leaves leaves the line (and a
place granted as it left goes on to the next); only past max_queued is a request refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hybridserve.proto import common_pb2
from hybridserve.router.admission import UNREPORTED_CAPACITY, AdmissionController, Overloaded
from hybridserve.router.config import AdmissionConfig, ResilienceConfig
from hybridserve.router.prefix_index import PrefixIndex
from hybridserve.router.workers import WorkerSet


def test_defaults_queue_without_a_deadline_and_follow_the_workers() -> None:
    config = AdmissionConfig()
    assert config.max_running is None and config.queue_timeout_s is None and config.max_queued >= 65536
    assert ResilienceConfig().capacity_wait_s is None
    reported = [0]
    admission = AdmissionController(config, capacity=lambda: reported[0])
    assert admission.limit == UNREPORTED_CAPACITY
    reported[0] = 3000
    assert admission.limit == 3000
    assert AdmissionController(AdmissionConfig(max_running=7), capacity=lambda: 3000).limit == 7


async def _in_order() -> None:
    capacity = [2]
    admission = AdmissionController(AdmissionConfig(), capacity=lambda: capacity[0])
    assert admission.try_acquire() and admission.try_acquire() and not admission.try_acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await admission.acquire_async()
        order.append(i)

    tasks = []
    for i in range(6):
        tasks.append(asyncio.create_task(waiter(i)))
        await asyncio.sleep(0)  # each joins the line before the next
    await asyncio.sleep(0.01)
    assert admission.queued == 6 and order == []
    assert not admission.try_acquire()  # a newcomer does not overtake the line
    admission.release()
    await asyncio.sleep(0.01)
    assert order == [0]
    capacity[0] = 5  # the workers reported more room: the next waiters get in at the health poll
    admission.refresh()
    await asyncio.sleep(0.01)
    assert order == [0, 1, 2, 3] and admission.running == 5
    for _ in range(2):
        admission.release()
    await asyncio.gather(*tasks)
    assert order == list(range(6)) and admission.queued == 0
    for _ in range(5):
        admission.release()
    assert admission.running == 0


def test_waiters_get_in_in_arrival_order_and_when_capacity_grows() -> None:
    asyncio.run(_in_order())


async def _leaving() -> None:
    admission = AdmissionController(AdmissionConfig(max_running=1, max_queued=2, max_per_client=3))
    await admission.acquire_async("a")
    gone = asyncio.create_task(admission.acquire_async("a"))
    stays = asyncio.create_task(admission.acquire_async("b"))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as full:  # the line is at max_queued: 429
        await admission.acquire_async("c")
    assert full.value.queue_full and full.value.retryable_after_s >= 1
    gone.cancel()  # its client left while waiting
    await asyncio.sleep(0.01)
    assert admission.queued == 1
    admission.release("a")
    await stays
    assert admission.running == 1 and admission._per_client == {"b": 1}
    # a place granted at the moment its waiter is cancelled goes on to the next one in line
    late = asyncio.create_task(admission.acquire_async("a"))
    next_one = asyncio.create_task(admission.acquire_async("c"))
    await asyncio.sleep(0.01)
    admission.release("b")  # grants `late` ...
    late.cancel()  # ... which is cancelled before it runs
    await next_one
    assert late.cancelled() and admission.running == 1 and admission._per_client == {"c": 1}
    admission.release("c")
    assert admission.running == 0 and admission.queued == 0


def test_a_waiter_that_leaves_frees_its_place_in_line() -> None:
    asyncio.run(_leaving())


def test_a_router_queue_timeout_still_gives_503() -> None:
    async def run() -> None:
        admission = AdmissionController(AdmissionConfig(max_running=1, queue_timeout_s=0.05))
        await admission.acquire_async()
        with pytest.raises(Overloaded) as late:
            await admission.acquire_async()
        assert not late.value.queue_full and admission.queued == 0

    asyncio.run(run())


def test_worker_capacity_is_the_decode_workers_reported_batches() -> None:
    workers = WorkerSet(PrefixIndex(), ResilienceConfig(health_interval_s=60.0), subscribe=False)
    try:
        def handle(status: str, running: int, waiting: int) -> SimpleNamespace:
            return SimpleNamespace(health=common_pb2.HealthResponse(status=status, role="decode", max_running=running,
                                                                    max_num_waiting=waiting))

        assert workers.capacity() == 0
        workers.decode = [handle("ok", 242, 1024), handle("ok", 64, 40), handle("draining", 500, 1024),
                          SimpleNamespace(health=None)]  # type: ignore[list-item]
        # each: its running batch plus one more queued on it, at most half its own queue
        assert workers.capacity() == (242 + 242) + (64 + 20)
    finally:
        workers.decode = []
        workers.close()
