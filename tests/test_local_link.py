"""Two stages on one node talk over a Unix socket (mesh/stage/local_link.py): the same
sessions as over gRPC, bitwise the same answers, and only for callers holding the
cluster's token."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.mesh.control.driver import drive
from skippy.mesh.control.engine import GenerationRequest
from skippy.mesh.stage.grpc_service import GrpcOpener, StageServicer, message_limit, serve
from skippy.mesh.stage.local_link import LocalListener, LocalOpener, socket_name
from skippy.mesh.stage.security import StageCredentials, new_secret
from skippy.mesh.stage.server import StageServer
from skippy.mesh.stage.session import LinkDown
from skippy.proto import stage_pb2 as pb
from skippy.stages.runtime import StageSpec
from stage_calls import settled
from test_stage_security import GrpcChain

pytestmark = pytest.mark.timeout(300)

N_CTX = 512
PROMPTS = [[1] + [(i * k) % 30000 + 50 for i in range(60 + k)] for k in (43, 47, 53)]


@pytest.fixture(scope="module")
def chain(smollm2):
    """Stage 0 (layers 0-14) and stage 1 (15-29), each served over gRPC and its socket."""
    creds = StageCredentials.plain(new_secret())
    limit = message_limit(str(smollm2), N_CTX, "f16")
    stages = [StageServer(StageSpec(str(smollm2), a, b, i, 2, n_ctx=N_CTX), CacheConfig(),
                          policy="ResidentKv") for i, (a, b) in enumerate([(0, 15), (15, 30)])]
    served = []
    for stage in stages:
        servicer = StageServicer(stage, "127.0.0.1")
        rpc, address = serve(servicer, "127.0.0.1", creds, max_message=limit)
        served.append((rpc, address, LocalListener(servicer, address, creds.token, 8)))
    yield stages, served, creds, limit
    for rpc, _, local in served:
        rpc.stop(None)
        local.close()


def answers(chain, prompts, steps=4):
    """Greedy steps through the real driver: [[(token, logits row)]] per prompt."""
    stages, served, creds, limit = chain
    driver = GrpcChain(served[0][1], creds, limit)

    async def run():
        out = []
        try:
            for prompt in prompts:
                request = GenerationRequest(tuple(prompt), steps, logits=True)
                out.append([(s.token, s.logits) async for s in drive(driver, request)])
        finally:
            for channel in driver.channels:
                await channel.close()
        return out
    return asyncio.run(run())


def test_a_link_over_the_socket_answers_bitwise_as_grpc_and_keeps_lanes_warm(chain):
    stages, served, creds, limit = chain
    opener = LocalOpener.reaching(served[1][1], creds.token)
    assert opener is not None
    stages[0].link_next(GrpcOpener(served[1][1], creds, limit))
    over_grpc = answers(chain, PROMPTS)
    stages[0].link_next(opener)
    over_socket = answers(chain, PROMPTS)
    assert [[t for t, _ in a] for a in over_socket] == [[t for t, _ in a] for a in over_grpc]
    assert all(torch.equal(x, y)
               for a, b in zip(over_socket, over_grpc) for (_, x), (_, y) in zip(a, b))
    assert opener.idle.reused >= len(PROMPTS) - 1  # each request's stream kept for the next
    for stage in stages:
        assert settled(stage)["sessions"] == 0
    # the second pass found every prompt's lane warm at both stages, over the socket
    again = answers(chain, PROMPTS[:1], steps=2)
    assert [t for t, _ in again[0]] == [t for t, _ in over_grpc[0][:2]]


def test_a_caller_without_the_token_is_refused_and_nothing_is_computed(chain):
    stages, served, creds, _ = chain
    address = served[1][1]
    assert LocalOpener.reaching(address, new_secret()) is None
    before = settled(stages[1])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a call, no token first
        s.connect(socket_name(address))
        call = pb.StageCall(plan=pb.Plan(tokens=PROMPTS[0], limit=0)).SerializeToString()
        s.sendall(len(call).to_bytes(4, "little") + call)
        s.settimeout(10)
        assert s.recv(64) == b""  # closed without an answer
    assert settled(stages[1]) == before


def test_no_socket_where_no_stage_listens():
    assert LocalOpener.reaching("127.0.0.1:1", new_secret()) is None


def test_a_stage_gone_fails_the_link_as_a_broken_stream(chain):
    """A listener that closes ends its sessions: the link says so (the driver rebuilds)."""
    stages, served, creds, limit = chain
    opener = LocalOpener.reaching(served[1][1], creds.token)
    link = opener()
    reply = link.ask(pb.StageCall(plan=pb.Plan(tokens=PROMPTS[2], limit=len(PROMPTS[2]) - 1)))
    assert reply.WhichOneof("result") == "plan"
    listener = served[1][2]
    listener.close()
    with pytest.raises(LinkDown):
        link.ask(pb.StageCall(prefill=pb.Prefill(tokens=PROMPTS[2], start=0)))
    link.end()
    assert settled(stages[1])["sessions"] == 0
    servicer = listener.servicer  # serve again for the other tests of the module
    served[1] = (served[1][0], served[1][1],
                 LocalListener(servicer, served[1][1], creds.token, 8))
