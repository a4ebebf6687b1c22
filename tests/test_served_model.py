"""What an engine serves: the one plan both engines build their stages from."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.control.served_model import ServedModel
from skippy.stages.runtime import StageError
from skippy.stages.runtime_kind import LLAMA_CPP, TORCH
from skippy.topology.planner import NodeSpec, PlanError, topology_digest

GiB = 2**30


def one_node(memory: int):
    return lambda _digest: [NodeSpec("elsewhere", memory, 2)]


def test_the_in_process_engine_serves_the_plan_of_any_one_node(qwen3_f32):
    engine = InProcessEngine(qwen3_f32, 3, n_ctx=256, cache=CacheConfig(enabled=False))
    for memory in (8 * GiB, 64 * GiB):  # memory cannot weigh stages sharing a node
        served = ServedModel.open(qwen3_f32, TORCH, one_node(memory), stages=3, n_ctx=256,
                                  overhead_bytes=0)
        assert served.plan.ranges == engine.model.plan.ranges == [(0, 2), (2, 4), (4, 6)]
        assert [s.spec for s in engine.servers] == \
            [served.spec(i, chunk=engine.cache.chunk) for i in range(3)]
    assert engine.info.topology_digest == topology_digest(
        served.plan.model_digest, [(0, 2), (2, 4), (4, 6)], "f16")
    assert (engine.info.n_ctx, engine.info.n_stages, engine.info.extra["runtime"]) == \
        (256, 3, "torch")


def test_given_ranges_are_served_as_given(qwen3_f32):
    engine = InProcessEngine(qwen3_f32, ranges=[(0, 1), (1, 6)], n_ctx=256)
    assert [(s.spec.layer_start, s.spec.layer_end) for s in engine.servers] == [(0, 1), (1, 6)]
    with pytest.raises(PlanError, match="contiguous"):
        InProcessEngine(qwen3_f32, ranges=[(0, 2), (3, 6)], n_ctx=256)


def test_what_the_runtime_cannot_serve_is_refused_before_planning(qwen3_f32, tmp_path):
    with pytest.raises(StageError, match="use --stages 1"):
        ServedModel.open(qwen3_f32, LLAMA_CPP, one_node(8 * GiB), stages=2)
    with pytest.raises(StageError, match="no weight formats"):
        ServedModel.open(qwen3_f32, LLAMA_CPP, one_node(8 * GiB), weight_format="int8")
    with pytest.raises(PlanError, match="needs at least"):
        ServedModel.open(qwen3_f32, TORCH, one_node(2**20), stages=2)


def test_both_engines_build_their_stages_from_the_same_plan(qwen3_f32):
    """An embedded Ray is one node, this machine: the Ray engine's actors get the specs the
    in-process engine's stages get (threads aside: actors share their node's cores)."""
    pytest.importorskip("ray")
    from skippy.mesh.control.ray_engine import RayEngine
    local = InProcessEngine(qwen3_f32, 2, n_ctx=256, cache=CacheConfig(enabled=False))
    remote = RayEngine(qwen3_f32, 2, n_ctx=256, cache=CacheConfig(enabled=False))
    try:
        given = [remote._launch.spec(st)[0] for st in remote.plan.stages]
        assert [dataclasses.replace(s, threads=None) for s in given] == \
            [s.spec for s in local.servers]
        assert remote.info.topology_digest == local.info.topology_digest
        assert [s["layers"] for s in remote.stats()["stages"]] == [[0, 3], [3, 6]]
        ids = list(range(40, 60))
        assert [s.token for s in local.complete(ids, 4)] == \
            [s.token for s in asyncio.run(_steps(remote, ids, 4))]
    finally:
        asyncio.run(remote.close())


async def _steps(engine, ids, n):
    from skippy.mesh.control.engine import GenerationRequest
    return [s async for s in engine.generate(GenerationRequest(tuple(ids), n))]
