"""The driver's streams to stage 0, and each stage's to the next, on a Ray pipeline
(mesh/control/ray_pipeline.py, mesh/stage/grpc_service.py): a request that ended with its
last call answered leaves its streams open for the next request, which gives the answer a
fresh stream gives; decode steps are answered by the last stage straight to the driver;
on one node, over the stages' sockets."""

from __future__ import annotations

import asyncio


def test_requests_take_the_streams_the_last_ones_left_and_answer_the_same(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.cache.telemetry import CacheStats
    from skippy.mesh.front.metrics import stage_families
    from skippy.mesh.control.engine import GenerationRequest
    from skippy.mesh.control.ray_engine import RayEngine
    engine = RayEngine(smollm2, 2, weight_format="int4", n_ctx=256, lanes=2,
                       cache=CacheConfig(enabled=False))
    try:
        prompts = [(1, *[(i * 41 + k * 97) % 30000 + 50 for i in range(24)]) for k in range(4)]
        # max_tokens reached (not a stop token): each request's last decode is its last call
        requests = [GenerationRequest(p, 3, speculate=False, stop_ids=frozenset())
                    for p in prompts]

        async def one(r):
            return [s.token async for s in engine.generate(r)]

        async def in_turn():
            return [await one(r) for r in requests]
        # each on a loop of its own: a channel, and so a stream, of its own
        fresh = [asyncio.run(one(r)) for r in requests]
        assert asyncio.run(in_turn()) == fresh
        # the in-turn loop's channel (the fresh ones' loops are closed)
        assert max(e.idle.reused for e in engine.pipelines[0]._channels.values()) == \
            len(requests) - 1
        # stage 0's stream to stage 1 outlives the driver's loops: every request but the
        # first took it
        first, last = engine.pipeline_stats(0)
        assert first["streams_reused"] == 2 * len(requests) - 1
        # each request's middle token came straight from the last stage (its last token
        # came back through stage 0, ending the sessions on its way)
        assert last["direct_replies"] == 2 * len(requests)
        # on one node every stream went over the stages' sockets, not gRPC: the driver's
        # at stage 0, and at the last stage stage 0's and the driver's reply streams
        assert first["local_streams"] >= len(requests) and last["local_streams"] >= 2
        memo = CacheStats("results", 0, 0, 0, 0, 0, {})
        (reused,) = [m for m in stage_families(engine.stats(), memo)
                     if m.name == "skippy_stage_streams_reused"]
        assert {s.labels["stage"]: s.value for s in reused.samples
                if s.name.endswith("_total")} == {"0": 2 * len(requests) - 1}
        # two stages sharing the node's cores take turns at them (mesh/stage/turns.py),
        # each step on both: requests at once answer as they do one at a time

        async def at_once():
            return await asyncio.gather(*(one(r) for r in requests))
        assert asyncio.run(at_once()) == fresh
        first, last = engine.pipeline_stats(0)
        assert "turn_wait_seconds" in first and "turn_wait_seconds" in last
    finally:
        asyncio.run(engine.close())
