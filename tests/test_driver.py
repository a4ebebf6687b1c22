"""The driver (mesh/control/driver.py) over a pipeline whose stages are down. Requests
waiting out a repair are tests/test_node_loss.py's and tests/test_host_loss.py's; here, a
readiness probe answers "not now" at once and leaves the repair running."""

from __future__ import annotations

import asyncio

import pytest

from skippy.mesh.control.driver import StageFault, drive
from skippy.mesh.control.engine import GenerationRequest
from skippy.topology.errors import OverCapacity


class DownPipeline:
    """Every session fails; a repair takes `repair_s` and leaves it down."""

    def __init__(self, repair_s: float):
        self.generation, self.healthy, self.addresses = 0, True, []
        self.repair_s, self.repairs, self.repaired = repair_s, 0, asyncio.Event()

    async def open(self):
        raise StageFault("stage 0 is unreachable: UNAVAILABLE")

    async def repair(self, generation: int) -> None:
        self.repairs += 1
        self.healthy = False
        await asyncio.sleep(self.repair_s)
        self.generation += 1
        self.repaired.set()


def test_a_probe_facing_a_stage_fault_is_busy_at_once_and_starts_the_repair():
    async def run():
        pipe = DownPipeline(repair_s=0.5)
        t = asyncio.get_running_loop().time()
        with pytest.raises(OverCapacity, match="being repaired"):
            async for _ in drive(pipe, GenerationRequest((1, 2), 1, probe=True)):
                pass
        answered = asyncio.get_running_loop().time() - t
        await asyncio.wait_for(pipe.repaired.wait(), 5)
        return answered, pipe.repairs
    answered, repairs = asyncio.run(run())
    assert answered < 0.25 and repairs == 1



def test_a_first_try_plans_and_prefills_in_one_call(smollm2):
    """The driver's first call of a request asks stage 0 to plan and prefill at once (one
    round trip, not two); the answer is the one the uncached path gives."""
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine

    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(enabled=False), speculate=False)
    calls: list[tuple[str, bool]] = []
    pipe = engine.pipes[0]
    opened = pipe.open

    async def counting_open():
        link = await opened()
        ask = link.ask

        async def counted(call):
            kind = call.WhichOneof("call")
            calls.append((kind, kind == "plan" and call.plan.prefill))
            return await ask(call)
        link.ask = counted
        return link
    pipe.open = counting_open
    try:
        prompt = list(range(1000, 1040))
        steps = engine.complete(prompt, 3)
        assert calls == [("plan", True), ("decode", False), ("decode", False)], calls
        assert steps[0].cached_tokens == 0
        assert [s.token for s in steps] == \
            [s.token for s in engine.complete(prompt, 3, probe=True)]  # a probe: no cache
    finally:
        asyncio.run(engine.close())
