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
from skippy.mesh.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
PROMPT = "The history of the printing press begins"


# Each node's memory said outright: left to Ray, each node takes the host's available
# memory when it starts, which other processes' moves make differ by more than a stage,
# and the roomiest node for the lost stage is then not always the empty one.
NODE = dict(num_cpus=1, memory=4 * 2**30, object_store_memory=100 * 2**20)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    from hosts import NODE_DEATH
    c = Cluster(initialize_head=True, connect=True,
                head_node_args={**NODE, "include_dashboard": False,
                                "_system_config": NODE_DEATH})
    for _ in range(2):
        c.add_node(**NODE)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


PROMPTS = [PROMPT, "Rivers carry sediment to", "A good night's sleep", "In 1969 the first"]


def test_a_node_lost_under_four_streams_moves_its_stage_and_every_answer_stays(
        cluster, smollm2):
    tok = Tokenizer(smollm2)
    asks = [tok.encode(p) for p in PROMPTS]
    local = InProcessEngine(smollm2, 2, n_ctx=1024, cache=CacheConfig(enabled=False))
    want = [[s.token for s in local.complete(ids, 16)] for ids in asks]
    engine = RayEngine(smollm2, 2, model_name="smollm2", n_ctx=1024, cache=CacheConfig())
    try:
        head = ray.get_runtime_context().get_node_id()
        placed = engine.node_ids()
        lost = next(n for n in placed if n != head)  # the driver's node stays
        node = next(n for n in cluster.worker_nodes if n.node_id == lost)
        got, recovery = asyncio.run(_streams_losing(engine, asks, cluster, node))
        assert got == want
        now = engine.node_ids()
        assert lost not in now and len(set(now) - set(placed)) == 1
        assert engine.info.topology_digest == engine.plan.digest  # the same split
        assert engine.stats()["recreated"] >= 1
        print(f"4 streams finished {recovery:.1f} s after the node was lost")
    finally:
        asyncio.run(engine.close())


async def _streams_losing(engine, asks, cluster, node, max_tokens: int = 16):
    """Four greedy streams of `max_tokens`; once each has 2 tokens, `node` is removed
    (SIGKILL)."""
    from skippy.mesh.control.engine import GenerationRequest
    tokens: list[list[int]] = [[] for _ in asks]
    started = asyncio.Event()

    async def run(i):
        async for step in engine.generate(GenerationRequest(tuple(asks[i]), max_tokens)):
            tokens[i].append(step.token)
            if all(len(t) >= 2 for t in tokens):
                started.set()

    runs = asyncio.gather(*(run(i) for i in range(len(asks))))
    await started.wait()
    await asyncio.to_thread(cluster.remove_node, node, False)
    t = time.monotonic()
    await runs
    return tokens, time.monotonic() - t
