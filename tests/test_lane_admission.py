"""The engine's lane admission: several lanes at once, first come first served, a bounded
line and a bounded wait (mesh/control/admission.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from skippy.mesh.control.admission import LaneAdmission
from skippy.topology.errors import OverCapacity


def test_a_request_takes_all_its_lanes_at_once_and_waits_in_line():
    async def run():
        a = LaneAdmission(8, wait_s=5)
        await a.acquire(6)
        order = []

        async def want(k, name):
            await a.acquire(k)
            order.append(name)
        big = asyncio.create_task(want(4, "big"))      # 6 + 4 > 8: waits
        await asyncio.sleep(0.01)
        small = asyncio.create_task(want(1, "small"))  # would fit, but the line is first
        await asyncio.sleep(0.01)
        assert order == [] and a.waiting == 2
        a.release(6)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and a.in_use == 5
    asyncio.run(run())


def test_a_full_line_or_a_long_wait_is_busy_with_retry_after():
    async def run():
        a = LaneAdmission(2, queue=1, wait_s=0.1)
        await a.acquire(2)
        waiter = asyncio.create_task(a.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(OverCapacity) as full:      # the line holds one
            await a.acquire()
        assert full.value.retry_after > 0
        with pytest.raises(OverCapacity):              # the one in line gave up
            await waiter
        assert a.waiting == 0 and a.in_use == 2 and a.refused == 2
        with pytest.raises(ValueError):
            await a.acquire(3)                       # more than the budget: never
    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_line_and_lanes_pass_across_event_loops():
    a = LaneAdmission(1, wait_s=5)
    asyncio.run(a.acquire())
    got = threading.Event()

    def other_loop():
        async def take():
            await a.acquire()
            got.set()
        asyncio.run(take())
    t = threading.Thread(target=other_loop)
    t.start()

    async def cancel_one():
        task = asyncio.create_task(a.acquire())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(cancel_one())
    a.release()
    t.join(5)
    assert got.is_set() and a.in_use == 1 and a.waiting == 0


def test_while_paused_every_request_waits_and_goes_on_after():
    """A plan changing (RayEngine.restore): free lanes or not, nobody takes one."""
    async def run():
        a = LaneAdmission(4, wait_s=5)
        await a.acquire(1)
        a.pause(True)
        a.release(1)                                   # lanes come free: still none taken
        waiters = [asyncio.create_task(a.acquire()) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert a.in_use == 0 and a.waiting == 2
        a.pause(False)
        await asyncio.gather(*waiters)
        assert a.in_use == 2 and a.waiting == 0
    asyncio.run(run())
