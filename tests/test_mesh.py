"""The mesh end to end: a real two-node Ray cluster on this machine, stage actors on
different nodes, frames over gRPC, the OpenAI gateway over HTTP, the official client.

Runs inside the loopback-only namespace (DESIGN.md §9); one module-scoped cluster."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("ray")

import openai  # noqa: E402
import ray  # noqa: E402

from skippy.cache.config import CacheConfig  # noqa: E402
from skippy.mesh.front.chat import render_chat  # noqa: E402
from skippy.mesh.front.gateway import BackgroundServer, create_app  # noqa: E402
from skippy.mesh.control.local import InProcessEngine  # noqa: E402
from skippy.mesh.control.ray_engine import RayEngine  # noqa: E402
from skippy.mesh.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five.",
             "What is 2 + 2?", "Say hello in Spanish.", "What do bees make?",
             "Why is the sky blue?", "Tell me about the Moon."]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "resources": {"skippy_node_a": 1}, "include_dashboard": False,
        "object_store_memory": 100 * 2**20})
    c.add_node(num_cpus=1, resources={"skippy_node_b": 1}, object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def engine(cluster, smollm2):
    eng = RayEngine(smollm2, 2, model_name="smollm2", cache=CacheConfig(), n_ctx=2048)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, api_keys=[])) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2):
    """What the in-process pipeline (no cache) answers: the output to match."""
    tok = Tokenizer(smollm2)
    local = InProcessEngine(smollm2, 2, n_ctx=2048, cache=CacheConfig(enabled=False))

    def answer(question: str, max_tokens: int) -> str:
        ids = tok.encode(render_chat(smollm2, [{"role": "user", "content": question}]))
        steps = local.complete(ids, max_tokens, stop_ids=frozenset(tok.eog_ids))
        return tok.decode([s.token for s in steps])
    return answer


def test_stages_run_on_different_nodes(engine, cluster):
    nodes = engine.node_ids()
    assert len(nodes) == 2 and nodes[0] != nodes[1]
    assert set(nodes) <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_status_json_names_each_stages_node_and_lanes(engine, server):
    import httpx
    status = httpx.get(server.url + "/status.json", timeout=60).json()
    nodes = [n[:12] for n in engine.node_ids()]
    assert [(row["stage"], row["node"]) for row in status["plan"]["stages"]] == \
        [(0, nodes[0]), (1, nodes[1])]
    assert {n["name"] for n in status["plan"]["nodes"]} == set(nodes)
    assert all(n["memory"] > 0 for n in status["plan"]["nodes"])
    assert {n["node"] for n in status["nodes"]} == set(nodes)
    for stage in status["stages"]:  # the stage actors' own figures, over Ray
        assert stage["lanes_busy"]["v"] + stage["lanes_free"]["v"] == engine.info.lanes
        assert stage["queue_rows"]["v"] == 0 and stage["weight_format"] == "fp32"


def test_nodes_say_which_package_layers_they_hold(cluster, smollm2, tmp_path_factory):
    from skippy.mesh.control.ray_engine import cluster_nodes
    from skippy.stages.package import split_package
    pkg = tmp_path_factory.mktemp("pkg") / "smollm2"
    manifest = split_package(smollm2, pkg)
    nodes = cluster_nodes(pkg, manifest.model_digest)  # one filesystem: both hold all
    assert len(nodes) == 2 and all(n.layers == frozenset(range(30)) for n in nodes)
    assert all(not n.layers for n in cluster_nodes(pkg, "0" * 64))
    assert all(not n.layers for n in cluster_nodes())


def chat(client, question, max_tokens=16, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, **{"temperature": 0, **kw})


def test_chat_matches_the_in_process_pipeline(client, reference):
    got = chat(client, QUESTIONS[0])
    assert got.choices[0].message.content == reference(QUESTIONS[0], 16)
    stream = chat(client, QUESTIONS[1], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference(QUESTIONS[1], 16)


def test_repeat_reports_cached_tokens(client):
    long_q = "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 20
    first = chat(client, long_q, max_tokens=2)
    chat(client, long_q, max_tokens=3)           # second sighting: the prefix is admitted
    again = chat(client, long_q, max_tokens=4)   # more tokens than known: the stages run
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert again.choices[0].message.content.startswith(first.choices[0].message.content)


def test_eight_concurrent_streams_match_each_alone(client, reference):
    results: dict[int, str] = {}

    def run(i):
        stream = chat(client, QUESTIONS[i], max_tokens=12, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(8))
    for i, text in results.items():
        assert text == reference(QUESTIONS[i], 12), QUESTIONS[i]


def test_sampling_adjustments_cross_the_stages(client, smollm2):
    # logit_bias and the penalties travel in the prefill to the last stage, which samples
    tok = Tokenizer(smollm2)
    forced = tok.encode(" blue")[0]
    got = chat(client, QUESTIONS[1], max_tokens=5, logit_bias={str(forced): 100})
    assert tok.encode(got.choices[0].message.content) == [forced] * 5
    ids = tok.encode(chat(client, QUESTIONS[2], max_tokens=16, frequency_penalty=2.0,
                          presence_penalty=2.0).choices[0].message.content)
    assert len(set(ids)) >= len(ids) - 2


def test_a_negative_seed_is_the_same_stream_as_its_unsigned_form(client):
    a = chat(client, QUESTIONS[4], max_tokens=6, temperature=1.0, seed=-5)
    b = chat(client, QUESTIONS[4], max_tokens=6, temperature=1.0, seed=2**64 - 5)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_choices_run_in_lanes_of_their_own(client, reference):
    got = chat(client, QUESTIONS[3], max_tokens=8, n=3)
    assert [c.message.content for c in got.choices] == [reference(QUESTIONS[3], 8)] * 3


def test_logprobs_come_back_from_the_last_stage(client, reference):
    got = chat(client, QUESTIONS[0], max_tokens=6, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == reference(QUESTIONS[0], 6)
    assert "".join(c.token for c in content) == got.choices[0].message.content
    assert all(c.top_logprobs[0].token == c.token and c.logprob <= 0 for c in content)


def test_client_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        chat(client, "x", max_tokens=0)


def test_a_killed_stage_costs_time_not_the_answer(engine, client, reference):
    """Ray restarts the actor (its state is gone); the router rebuilds the request."""
    ray.kill(engine.actors[1], no_restart=False)
    got = chat(client, QUESTIONS[6])
    assert got.choices[0].message.content == reference(QUESTIONS[6], 16)


def test_a_stage_killed_mid_stream_leaves_a_seeded_answer_as_it_was(engine, client):
    """The rebuilt request's sampler continues the seed's sequence (a fresh cache_salt
    each time: the exact-results memo would answer the repeat without the stages)."""
    ask = {"temperature": 0.9, "seed": 11, "max_tokens": 24}
    want = chat(client, QUESTIONS[5], extra_body={"cache_salt": "calm"}, **ask)
    stream = chat(client, QUESTIONS[5], stream=True, extra_body={"cache_salt": "fault"}, **ask)
    text, gaps, last = [], [], time.monotonic()
    for i, chunk in enumerate(stream):
        if i == 4:
            ray.kill(engine.actors[1], no_restart=False)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    assert max(gaps[5:]) > 0.5  # the stream waited for the restarted stage mid-way
    assert "".join(text) == want.choices[0].message.content


def test_two_pipelines_route_by_cached_prefix(cluster, smollm2, reference):
    said: list[str] = []
    eng = RayEngine(smollm2, 2, pipelines=2, model_name="smollm2", n_ctx=2048,
                    cache=CacheConfig(admit_after=1), progress=said.append)
    try:
        # each stage said as it comes up, the last with all the weights' bytes
        loading = [s for s in said if s.startswith("loading 4 stage(s): ")]
        assert [s.split()[-2] for s in loading] == ["1/4", "2/4", "3/4", "4/4"], said
        assert "100%" in loading[-1] and "B/s" in loading[-1], said
        with BackgroundServer(create_app(eng, api_keys=[])) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
            long_q = "Answer briefly. " + "Bees make honey from nectar. " * 12
            for i, q in enumerate([long_q + "Why?", long_q + "How?"]):
                got = chat(c, q, max_tokens=4)
                assert got.choices[0].message.content == reference(q, 4)
            # the second shared the first's prefix: same pipeline, served from its cache
            assert got.usage.prompt_tokens_details.cached_tokens >= 64
            assert eng.stats()["in_flight"] == [0, 0]
    finally:
        asyncio.run(eng.close())
