"""Who may call a stage (mesh/stage/security.py), over real gRPC in this process: calls
without the cluster's token, or with a wrong one, are refused before a stage computes or
caches anything; with TLS the port speaks nothing else and takes only this cluster's
certificates; a forged prefill cannot change what the chain answers."""

from __future__ import annotations

import asyncio
import queue

import grpc
import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.mesh.control.driver import drive
from skippy.mesh.control.engine import GenerationRequest
from skippy.mesh.control.stage_link import GrpcStageLink
from skippy.mesh.stage import security
from skippy.mesh.stage.channels import channel_options
from skippy.mesh.stage.grpc_service import GrpcOpener, message_limit, start_server
from skippy.mesh.stage.security import (ClusterCredentials, SecretError, StageCredentials,
                                        load_secret, new_secret, tls_wanted)
from skippy.mesh.stage.server import StageServer
from skippy.mesh.wire import frame_to_proto
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc
from skippy.stages.frame import Frame
from skippy.stages.runtime import StageSpec
from stage_calls import session_stream, settled

pytestmark = pytest.mark.timeout(300)

N_CTX = 512
PROMPT = [1] + [(i * 41) % 30000 + 50 for i in range(70)]
WRONG = (("x-skippy-cluster-token", "0" * 64),)


# -- the secret ------------------------------------------------------------------------------
def test_a_secret_comes_from_the_file_then_the_environment_then_chance(tmp_path, monkeypatch):
    monkeypatch.delenv(security.SECRET_ENV, raising=False)
    assert load_secret() != load_secret()                 # a new random one each time
    monkeypatch.setenv(security.SECRET_ENV, "from-env\n")
    assert load_secret() == "from-env"
    path = tmp_path / "secret"
    path.write_text("  from-file\n")
    path.chmod(0o600)  # only its owner may read it
    assert load_secret(str(path)) == "from-file"          # the file wins


@pytest.mark.parametrize("content", [None, "", " \n"])
def test_a_missing_or_empty_secret_file_is_an_error(tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)  # only its owner may read it
    with pytest.raises(SecretError, match=str(path)):
        load_secret(str(path))


def test_tls_is_on_by_default_when_stage_traffic_can_leave_the_host():
    assert [tls_wanted("auto", grows) for grows in (False, True)] == [False, True]
    assert tls_wanted("on", False) and not tls_wanted("off", True)


def test_credentials_never_print_their_token_or_key():
    creds = ClusterCredentials("s3cret", tls=True).issue()
    assert creds.token not in repr(creds) and "PRIVATE KEY" not in repr(creds)


def test_the_message_limit_fits_a_whole_context_prefill_not_a_fixed_256_mib(smollm2):
    limit = message_limit(str(smollm2), 8192, "f16")
    assert 8192 * 576 * 2 < limit < 16 << 20      # SmolLM2: 576 wide, 49152-token vocab
    assert message_limit(str(smollm2), 8192, "f32") > limit


# -- one stage, served plainly and over TLS ---------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    return ClusterCredentials(new_secret(), tls=True)


@pytest.fixture(scope="module")
def stage(smollm2, cluster):
    """One whole-model stage behind two ports: plain TCP and TLS, the same token."""
    service = StageServer(StageSpec(str(smollm2), 0, 30, 0, 1, n_ctx=N_CTX), CacheConfig(),
                          policy="ResidentKv")
    tls = cluster.issue()
    plain = StageCredentials(tls.token)
    servers = [start_server(service, "127.0.0.1", c) for c in (plain, tls)]
    yield service, {"plain": (servers[0][1], plain), "tls": (servers[1][1], tls)}
    for rpc, _ in servers:
        rpc.stop(None)


def first_token(channel: grpc.Channel, metadata) -> pb.Token:
    """Plan and prefill PROMPT in one session: the first token (raises grpc.RpcError)."""
    q: queue.Queue = queue.Queue()
    replies = session_stream(channel, q, metadata, timeout=120)
    try:
        q.put(pb.StageCall(plan=pb.Plan(tokens=PROMPT, limit=len(PROMPT) - 1)))
        start = next(replies).plan.start
        q.put(pb.StageCall(prefill=pb.Prefill(tokens=PROMPT, start=start,
                                              sampling=pb.Sampling(logits=True))))
        return next(replies).token
    finally:
        q.put(None)


class Opened:
    """Counts the sessions a stage opens (a refused call must open none)."""

    def __init__(self, service: StageServer, monkeypatch):
        self.n = 0
        real = service.open_session

        def counted():
            self.n += 1
            return real()
        monkeypatch.setattr(service, "open_session", counted)


def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.mark.parametrize("port", ["plain", "tls"])
def test_a_call_without_the_token_or_with_a_wrong_one_does_no_work(stage, port, monkeypatch):
    service, ports = stage
    address, creds = ports[port]
    opened = Opened(service, monkeypatch)
    before = settled(service)
    with creds.channel(address, []) as channel:
        for metadata in ((), WRONG):
            assert refused(lambda: first_token(channel, metadata)) == \
                grpc.StatusCode.UNAUTHENTICATED
            blocks = stage_pb2_grpc.StageStub(channel).GetBlocks(
                pb.BlockRequest(hashes=[b"\0" * 32]), metadata=metadata)
            assert refused(lambda: list(blocks)) == grpc.StatusCode.UNAUTHENTICATED
    assert opened.n == 0
    assert settled(service) == before      # nothing computed, nothing cached
    with creds.channel(address, []) as channel:
        assert first_token(channel, creds.metadata).id >= 0   # the same port, with the token
    assert opened.n == 1


def test_a_tls_port_refuses_plain_tcp_and_other_clusters(stage, cluster, monkeypatch):
    service, ports = stage
    address, creds = ports["tls"]
    opened = Opened(service, monkeypatch)
    before = settled(service)
    stranger = ClusterCredentials(new_secret(), tls=True).issue()   # another cluster's CA
    no_cert = grpc.ssl_channel_credentials(root_certificates=creds.ca)  # verifies us only
    peer = [("grpc.ssl_target_name_override", security.PEER_NAME)]
    channels = [grpc.insecure_channel(address), stranger.channel(address, []),
                grpc.secure_channel(address, no_cert, peer)]
    for channel in channels:
        with channel:
            # the right token does not help: the handshake fails before any call
            assert refused(lambda: first_token(channel, creds.metadata)) == \
                grpc.StatusCode.UNAVAILABLE
    assert opened.n == 0
    assert settled(service) == before


def test_the_same_stage_answers_alike_over_tls_and_plain_tcp(stage):
    service, ports = stage
    answers = []
    for port in ("plain", "tls", "plain"):
        address, creds = ports[port]
        with creds.channel(address, []) as channel:
            token = first_token(channel, creds.metadata)
        answers.append((token.id, token.logits))
    assert answers[0] == answers[1] == answers[2]


# -- two stages: a forged prefill at the last one ---------------------------------------------
class GrpcChain:
    """The driver's side of a chain served over gRPC in this process, as RayPipeline's."""

    generation, healthy = 0, True

    def __init__(self, address: str, creds: StageCredentials, limit: int):
        self.address, self.creds, self.limit = address, creds, limit
        self.channels: list = []

    async def open(self) -> GrpcStageLink:
        channel = self.creds.channel(self.address, channel_options(self.limit), aio=True)
        self.channels.append(channel)
        return GrpcStageLink(stage_pb2_grpc.StageStub(channel), self.creds.metadata)

    async def repair(self, generation: int) -> None:
        pass


@pytest.fixture(scope="module")
def chain(smollm2):
    """Stage 0 (layers 0-14) linked to stage 1 (15-29) over gRPC; the driver's chain."""
    creds = StageCredentials.plain(new_secret())
    limit = message_limit(str(smollm2), N_CTX, "f16")
    stages = [StageServer(StageSpec(str(smollm2), a, b, i, 2, n_ctx=N_CTX), CacheConfig(),
                          policy="ResidentKv") for i, (a, b) in enumerate([(0, 15), (15, 30)])]
    servers = [start_server(s, "127.0.0.1", creds) for s in stages]
    stages[0].link_next(GrpcOpener(servers[1][1], creds, limit))
    yield GrpcChain(servers[0][1], creds, limit), servers[1][1], stages[1]
    for rpc, _ in servers:
        rpc.stop(None)


def answer(chain: GrpcChain, prompt: list[int], probe: bool = False):
    """Three greedy steps through the real driver: [(token, logits row)]."""
    async def run():
        request = GenerationRequest(tuple(prompt), 3, probe=probe, logits=True)
        try:
            return [(s.token, s.logits) async for s in drive(chain, request)]
        finally:
            for channel in chain.channels:
                await channel.close()
            chain.channels.clear()
    return asyncio.run(run())


def forge(address: str, prompt: list[int], metadata) -> pb.StageResult:
    """A prefill of made-up rows for `prompt`, sent straight to the last stage."""
    rows = torch.randn(len(prompt), 576).mul(50).to(torch.float16)
    frame = Frame(0, rows, torch.ones(len(prompt), dtype=torch.float32))
    call = pb.StageCall(prefill=pb.Prefill(tokens=prompt, start=0,
                                           frame=frame_to_proto(frame),
                                           sampling=pb.Sampling(logits=True)))
    with grpc.insecure_channel(address, options=channel_options(16 << 20)) as channel:
        return next(stage_pb2_grpc.StageStub(channel).Session(iter([call]), metadata=metadata))


def same(a, b) -> bool:
    return [t for t, _ in a] == [t for t, _ in b] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_a_forged_prefill_without_the_token_never_changes_the_answer(chain):
    driver, last, service = chain
    before = answer(driver, PROMPT, probe=True)   # computed, no cache touched
    for metadata in ((), WRONG):
        assert refused(lambda: forge(last, PROMPT, metadata)) == \
            grpc.StatusCode.UNAUTHENTICATED
    assert service.stats()["results"]["entries"] == 0
    after = answer(driver, PROMPT)                # may come from the results cache now
    again = answer(driver, PROMPT)
    assert same(before, after) and same(before, again)


def test_the_same_forgery_with_the_token_would_have_changed_it(chain):
    # What the check above stops: a caller holding the token is trusted with the caches.
    driver, last, _ = chain
    prompt = PROMPT[:-5] + [7, 8, 9, 10, 11]
    honest = answer(driver, prompt, probe=True)
    assert forge(last, prompt, driver.creds.metadata).WhichOneof("result") == "token"
    assert not same(answer(driver, prompt), honest)
