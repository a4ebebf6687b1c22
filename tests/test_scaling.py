"""Capacity that follows load (mesh/control/scaling.py): a pipeline more while requests
wait for lanes, released once idle.

The policy first, over an engine the test scripts (a fake inside a unit test of the code
around it); then real Ray stages: SmolLM2 with one lane a pipeline, five requests at once
— the waiting ones make the engine add a pipeline, every answer is the one each request
gives alone, and once idle the added pipeline is released and the engine serves on.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from skippy.mesh.control.scaling import Scaler, ScalingPolicy


class ScriptedEngine:
    def __init__(self, room: int):
        self.admission = SimpleNamespace(waiting=0)
        self.router = SimpleNamespace(load=[0])
        self.room = room           # whole copies more the cluster can hold
        self.pipes = [0]
        self.retired: set[int] = set()
        self.alive = 1  # nodes
        self.asked: list[int] = []  # whole copies more asked of Ray's autoscaler

    def ask_for_room(self, more: int = 0) -> None:
        self.asked.append(more)

    def nodes(self) -> int:
        return self.alive

    def live(self) -> list[int]:
        return [p for p in self.pipes if p not in self.retired]

    async def grow(self):
        if not self.room:
            return None
        self.room -= 1
        self.pipes.append(len(self.pipes))
        self.router.load.append(0)
        return self.pipes[-1]

    async def restore(self) -> bool:
        return False  # its model was never cut anew

    async def shrink(self, p: int) -> None:
        self.retired.add(p)
        self.room += 1


def test_waiting_requests_add_pipelines_up_to_the_bound_and_idle_ones_go():
    async def run():
        e = ScriptedEngine(room=5)
        said: list[str] = []
        s = Scaler(e, ScalingPolicy(1, 3, wait_s=1.0, idle_s=5.0), said.append)
        e.admission.waiting = 2
        await s.tick(0.0)
        assert e.live() == [0]              # not waiting long enough yet
        await s.tick(1.0)
        assert e.live() == [0, 1] and "pipeline 1 added" in said[-1]
        await s.tick(1.5)
        await s.tick(2.5)
        assert e.live() == [0, 1, 2]
        await s.tick(4.0)
        await s.tick(9.0)
        assert e.live() == [0, 1, 2]        # the bound: 3
        e.admission.waiting = 0
        e.router.load = [1, 1, 0]           # 2 idle from here
        await s.tick(10.0)
        await s.tick(15.0)
        assert e.live() == [0, 1] and said[-1].startswith("pipeline 2 idle")
        e.router.load = [0, 0, 0]
        await s.tick(16.0)
        await s.tick(21.0)
        await s.tick(40.0)
        assert e.live() == [0]              # the first stays
        assert (s.added, s.released) == (2, 2)
    asyncio.run(run())


def test_no_room_for_a_copy_waits_before_looking_again():
    async def run():
        e = ScriptedEngine(room=0)
        s = Scaler(e, ScalingPolicy(1, 2, wait_s=1.0, idle_s=5.0))
        e.admission.waiting = 1
        await s.tick(0.0)
        await s.tick(1.0)                   # grow found no room: a copy more asked for
        assert e.asked == [1]
        e.room = 1                          # a node joins
        await s.tick(2.0)
        await s.tick(5.0)
        assert e.live() == [0]              # not before 10 x wait_s
        await s.tick(11.0)
        await s.tick(12.0)
        assert e.live() == [0, 1] and e.asked == [1]  # (the engine's grow asks anew)
    asyncio.run(run())


def test_a_node_that_joins_gets_a_pipeline_where_a_copy_fits():
    async def run():
        e = ScriptedEngine(room=0)
        said: list[str] = []
        s = Scaler(e, ScalingPolicy(1, 2, wait_s=1.0, idle_s=60.0), said.append)
        await s.tick(0.0)                   # the first count: 1 node
        e.alive, e.room = 2, 1              # a node joins, with room for a copy
        await s.tick(1.0)
        assert e.live() == [0]              # counted every 2 s
        await s.tick(2.5)
        assert e.live() == [0, 1] and said[-1].startswith("a node joined: pipeline 1")
        e.alive = 3                         # another, but the bound is 2
        await s.tick(5.0)
        assert e.live() == [0, 1]
    asyncio.run(run())


def test_ray_engine_adds_a_pipeline_under_waiting_requests_and_releases_it(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.engine import GenerationRequest
    from skippy.mesh.control.ray_engine import RayEngine
    engine = RayEngine(smollm2, 1, weight_format="int4", n_ctx=256, lanes=1,
                       cache=CacheConfig(enabled=False),
                       scaling=ScalingPolicy(1, 2, wait_s=0.2, idle_s=5.0))
    try:
        # five requests of 200 tokens on one lane (four wait: the queue holds four a
        # lane): seconds of waiting, longer than a pipeline takes to load; the added
        # one idles 5 s before its release, longer than the other may still be busy
        prompts = [(1, *[(i * 37 + k * 101) % 30000 + 50 for i in range(20)])
                   for k in range(5)]
        requests = [GenerationRequest(p, 200, speculate=False) for p in prompts]

        async def one(r):
            return [s.token async for s in engine.generate(r)]

        async def alone():
            return [await one(r) for r in requests]

        async def together():
            return await asyncio.gather(*(one(r) for r in requests))
        want = asyncio.run(alone())
        assert engine.live() == [0]
        copy = [{"memory": float(st.total_bytes)} for st in engine.plan.stages]
        assert _asked_of_autoscaler() == copy  # its stages' room kept
        assert asyncio.run(together()) == want
        stats = engine.stats()
        assert stats["scaling"]["added"] == 1 and stats["scaling"]["pipelines"] == 2
        assert _asked_of_autoscaler() == copy * 2
        assert engine.pipeline_stats(1)[0]["decode_rows"] > 0  # the new one served

        async def idle():
            engine.scaler.start()
            for _ in range(200):
                await asyncio.sleep(0.1)
                if engine.scaler.released:  # retired, and its stages gone
                    return
        asyncio.run(idle())
        assert engine.live() == [0] and engine.stats()["scaling"]["released"] == 1
        assert _asked_of_autoscaler() == copy
        assert engine.ask_for_room(1) == copy * 2  # no room while requests wait
        assert _asked_of_autoscaler() == copy * 2
        assert asyncio.run(one(requests[0])) == want[0]  # still serving
        asyncio.run(engine.close())  # (and its embedded Ray)
        from skippy.mesh.control import autoscaler_ask
        assert autoscaler_ask.ask(object(), []) == []  # its part withdrawn
    finally:
        asyncio.run(engine.close())


def _asked_of_autoscaler() -> list[dict]:
    """The cluster's standing request to Ray's autoscaler (v1's key: this Ray runs none)."""
    import json
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get
    assert not is_autoscaler_v2()
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []
