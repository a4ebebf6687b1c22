"""A prefix's state pulled from a peer stage (another pipeline, another node) over the
authenticated stage network: the receiving stage adopts it as a cache entry and answers
bitwise as a cold run does; another tenant, another split or a vanished peer gets
nothing and recomputes."""

from __future__ import annotations

import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.mesh.stage.grpc_service import message_limit, start_server
from skippy.mesh.stage.security import ClusterCredentials, new_secret
from skippy.mesh.stage.server import StageServer
from skippy.mesh.stage.state_pull import StatePuller
from skippy.stages.runtime import StageSpec
from stage_calls import run

TURN1 = [(i * 37 + 11) % 5000 + 10 for i in range(200)]
TURN2 = TURN1 + [(i * 53 + 5) % 5000 + 10 for i in range(60)]


@pytest.fixture(scope="module", params=["ResidentKv", "KvRecurrent"])
def stages(request, qwen3_f32):
    """Three single-stage pipelines of one model: a holder, a puller, a cold reference."""
    cluster = ClusterCredentials(new_secret(), tls=True)
    limit = message_limit(str(qwen3_f32), 8192, "f16")
    made = []
    for _ in range(3):
        server = StageServer(StageSpec(str(qwen3_f32), 0, 6, 0, 1, topology_digest="t"),
                             CacheConfig(admit_after=1), policy=request.param)
        server.puller = StatePuller(cluster.issue(), limit)
        rpc, address = start_server(server, "127.0.0.1", cluster.issue(), limit)
        made.append((server, address, rpc))
    yield made
    for server, _, rpc in made:
        rpc.stop(None)
        server.puller.close()
        server.loop.stop()


def test_a_pulled_prefix_answers_bitwise_as_a_cold_run(stages):
    (holder, at, _), (puller, _, _), (cold, _, _) = stages
    run(holder, TURN1)
    cached, ids, rows = run(puller, TURN2, peers=[at])
    assert cached == 192  # every stride of turn 1 the holder prefilled
    assert puller.puller.stats()["pulls"] == 1 and puller.cache.peers.adopted == 1
    assert puller.puller.stats()["fetched_bytes"] > 0
    assert holder.cache.peers.exports == 1
    _, ids_cold, rows_cold = run(cold, TURN2)
    assert ids == ids_cold
    assert all(torch.equal(a, b) for a, b in zip(rows, rows_cold))
    # the puller now holds it: its own next turn needs no peer
    again, _, _ = run(puller, TURN2, peers=[at])
    assert again >= 192 and puller.puller.stats()["pulls"] == 1


def test_other_tenants_and_vanished_peers_get_nothing(stages):
    (holder, at, _), (puller, _, _), _ = stages
    run(holder, TURN1, namespace="tenant-a")
    before = puller.puller.stats()
    cached, _, _ = run(puller, TURN2 + [7], peers=[at], namespace="tenant-b")
    assert cached == 0 and puller.puller.stats()["pulls"] == before["pulls"]
    cached, _, _ = run(puller, TURN2 + [8], peers=["127.0.0.1:9"], namespace="tenant-c")
    assert cached == 0 and puller.puller.stats()["failed"] == before["failed"] + 1


def test_another_split_never_takes_the_state(stages, qwen3_f32):
    """Same layers, other upstream cuts (another topology digest): the peer's payload is
    refused on arrival, and the request recomputes."""
    (holder, at, _), (puller, _, _), _ = stages
    run(holder, TURN1)
    other = StageServer(StageSpec(str(qwen3_f32), 0, 6, 0, 1, topology_digest="u"),
                        CacheConfig(admit_after=1), policy=holder.cache.policy)
    other.puller = StatePuller(puller.puller._credentials, puller.puller._max_message)
    try:
        cached, _, _ = run(other, TURN2, peers=[at])
        assert cached == 0 and other.cache.peers.adopted == 0
        assert other.puller.stats()["failed"] == 1
    finally:
        other.puller.close()
        other.loop.stop()
