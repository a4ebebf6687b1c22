"""A node lost while serving: its stages move, with the same layer ranges, to the nodes
left, and requests complete with the fault-free answer (same split, same bits).

Three Ray nodes on this host (ray.cluster_utils); run inside a loopback-only namespace.
The 3-host harness of separate network namespaces is where whole-host loss is tested."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.control.ray_engine import RayEngine
from skippy.mesh.front.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 2**20})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def test_a_lost_nodes_stage_moves_and_the_answer_stays(cluster, smollm2):
    tok = Tokenizer(smollm2)
    ids = tok.encode(PROMPT)
    want = [s.token for s in InProcessEngine(smollm2, 2, n_ctx=1024, cache=CacheConfig(
        enabled=False)).complete(ids, 12)]
    engine = RayEngine(smollm2, 2, model_name="smollm2", n_ctx=1024,
                       cache=CacheConfig())
    try:
        assert [s.token for s in engine_complete(engine, ids, 12)] == want
        head = ray.get_runtime_context().get_node_id()
        placed = engine.node_ids()
        lost = next(n for n in placed if n != head)  # the driver's node stays
        node = next(n for n in cluster.worker_nodes if n.node_id == lost)
        cluster.remove_node(node, allow_graceful=False)
        t = time.monotonic()
        got = [s.token for s in engine_complete(engine, ids, 12)]
        recovery = time.monotonic() - t
        assert got == want
        now = engine.node_ids()
        assert lost not in now and len(set(now) - set(placed)) == 1
        assert engine.info.topology_digest == engine.plan.digest  # the same split
        print(f"recovered from the node loss in {recovery:.1f} s")
    finally:
        asyncio.run(engine.close())


def engine_complete(engine, ids, n):
    from skippy.mesh.control.engine import GenerationRequest

    async def run():
        return [s async for s in engine.generate(GenerationRequest(tuple(ids), n))]
    return asyncio.run(run())
