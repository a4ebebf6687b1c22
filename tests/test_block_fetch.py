"""Blocks fetched from a peer stage by hash, over the authenticated stage network (TLS):
only the blocks this host lacks, each checked against its BLAKE3 hash on receipt."""

from __future__ import annotations

import os

import pytest
from blake3 import blake3

from skippy.cache.blocks import BLOCK_SIZE, BlockStore
from skippy.cache.config import CacheConfig
from skippy.mesh.stage.block_fetch import BlockPeer
from skippy.mesh.stage.grpc_service import StageServicer, message_limit, serve, start_server
from skippy.mesh.stage.security import ClusterCredentials, StageCredentials, new_secret
from skippy.mesh.stage.server import StageServer
from skippy.proto import stage_pb2 as pb
from skippy.stages.runtime import StageSpec

BLOBS = [os.urandom(BLOCK_SIZE), os.urandom(1000), os.urandom(77)]
HASHES = [blake3(b).digest() for b in BLOBS]


@pytest.fixture(scope="module")
def cluster():
    return ClusterCredentials(new_secret(), tls=True)


@pytest.fixture(scope="module")
def holder(qwen3_f32, cluster):
    """A stage whose block store holds BLOBS, served over TLS."""
    server = StageServer(StageSpec(str(qwen3_f32), 0, 6, 0, 1), CacheConfig(),
                         policy="KvRecurrent")
    for blob in BLOBS:
        server.cache.store.put(blob)
    rpc, address = start_server(server, "127.0.0.1", cluster.issue())
    yield server, address
    rpc.stop(None)
    server.loop.stop()


@pytest.fixture
def peer(holder, cluster, qwen3_f32):
    p = BlockPeer(holder[1], cluster.issue(), message_limit(str(qwen3_f32), 8192, "f16"))
    yield p
    p.close()


def test_only_the_blocks_this_host_lacks_are_fetched_and_verified(peer):
    local = BlockStore()
    local.put(BLOBS[1])
    got = peer.fetch(HASHES + [HASHES[0]], local)  # a repeated hash is asked once
    assert got.held == 1 and not got.missing and not got.damaged
    assert got.blocks == {HASHES[0]: BLOBS[0], HASHES[2]: BLOBS[2]}
    assert got.bytes == BLOCK_SIZE + 77


def test_a_block_the_holder_lacks_or_holds_damaged_is_missing(holder, peer):
    unknown = blake3(b"never stored").digest()
    rotten = os.urandom(500)
    h = holder[0].cache.store.put(rotten)
    holder[0].cache.store._corrupt_for_test(h)
    got = peer.fetch([unknown, h, HASHES[2]])
    assert got.missing == [unknown, h] and list(got.blocks) == [HASHES[2]]


def test_a_caller_without_the_clusters_credentials_gets_nothing(holder, qwen3_f32):
    limit = message_limit(str(qwen3_f32), 8192, "f16")
    wrong = ClusterCredentials(new_secret(), tls=True).issue()  # another cluster
    stranger = BlockPeer(holder[1], wrong, limit)
    got = stranger.fetch(HASHES)
    stranger.close()
    assert got.missing == HASHES and not got.blocks


class _Mangler(StageServicer):
    """Flips a byte of each block the first time it is sent: damage in transit."""

    def __init__(self, server):
        super().__init__(server)
        self.sent: set[bytes] = set()

    def GetBlocks(self, request, context):
        for block in super().GetBlocks(request, context):
            if block.hash not in self.sent and block.data:
                self.sent.add(block.hash)
                data = bytearray(block.data)
                data[len(data) // 2] ^= 0xFF
                block = pb.Block(hash=block.hash, data=bytes(data))
            yield block


def test_a_block_damaged_in_transit_is_detected_and_fetched_again(holder, cluster,
                                                                  qwen3_f32):
    limit = message_limit(str(qwen3_f32), 8192, "f16")
    mangler = _Mangler(holder[0])
    rpc, address = serve(mangler, "127.0.0.1", cluster.issue(), max_message=limit)
    peer = BlockPeer(address, cluster.issue(), limit)
    try:
        got = peer.fetch(HASHES)
    finally:
        peer.close()
        rpc.stop(None)
    assert got.damaged == 3 and not got.missing
    assert got.blocks == dict(zip(HASHES, BLOBS))
