"""One request path: the in-process engine and 2 Ray stages run the same driver and stage
code, so they give the same tokens and log-probs; faults stay inside the request that
caused them; a stage killed mid-stream costs time, never a token.

Runs inside the loopback-only namespace (DESIGN.md §9)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal

import pytest
import torch

pytest.importorskip("ray")

import ray  # noqa: E402

from skippy.cache.config import CacheConfig  # noqa: E402
from skippy.mesh.control.local import InProcessEngine  # noqa: E402
from skippy.mesh.control.ray_engine import RayEngine  # noqa: E402
from skippy.evals import robustness  # noqa: E402
from skippy.mesh.front.connections import raise_file_limit  # noqa: E402
from skippy.mesh.front.gateway import BackgroundServer, create_app  # noqa: E402
from skippy.mesh.control.engine import GenerationRequest  # noqa: E402
from skippy.topology.errors import RequestError  # noqa: E402
from skippy.mesh.constraint import json_object  # noqa: E402
from skippy.mesh.sampler import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

NO_REBUILDS = {"fault": 0, "evicted": 0}
PROMPTS = [[1] + [(i * 37 + k * 101) % 30000 + 50 for i in range(40 + 13 * k)]
           for k in range(8)]


def _requests(stop: int) -> list[GenerationRequest]:
    p = PROMPTS
    seeded = [SamplingParams(temperature=0.8, seed=7 + i) for i in range(3)]  # n: 3
    return [
        GenerationRequest(tuple(p[0]), 12),
        GenerationRequest(tuple(p[1]), 12, SamplingParams(temperature=0.9, seed=5)),
        *[GenerationRequest(tuple(p[2]), 8, s) for s in seeded],
        GenerationRequest(tuple(p[3]), 8, SamplingParams(logprobs=3)),
        GenerationRequest(tuple(p[0]), 12, stop_ids=frozenset({stop})),
        GenerationRequest(tuple(p[4]), 12, SamplingParams(
            temperature=0.7, seed=3, presence_penalty=0.8, frequency_penalty=0.5,
            logit_bias=((stop, 5.0),))),
        GenerationRequest(tuple(p[0]), 12),   # a repeat: its first token from results
        # constrained: the last stage masks the logits (mesh/token_mask.py)
        GenerationRequest(tuple(p[5]), 12, SamplingParams(constraint=json_object())),
        GenerationRequest(tuple(p[6]), 12, SamplingParams(temperature=0.9, seed=11,
                                                          constraint=json_object())),
    ]


async def _collect(engine, request):
    return [(s.token, s.logprobs) for s in [s async for s in engine.generate(request)]]


async def _all(engine, requests):
    return await asyncio.gather(*[_collect(engine, r) for r in requests])


@pytest.fixture(scope="module")
def ray_engine(smollm2):
    eng = RayEngine(smollm2, 2, model_name="smollm2", cache=CacheConfig(), n_ctx=1024,
                    weight_format="int4", pipelines=2, restarts=1)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def local_engine(smollm2, ray_engine):
    ranges = [(st.start, st.end) for st in ray_engine.plan.stages]
    return InProcessEngine(smollm2, ranges=ranges, cache=CacheConfig(), n_ctx=1024,
                           weight_format="int4")


def test_in_process_and_ray_stages_answer_alike(local_engine, ray_engine):
    greedy = local_engine.complete(PROMPTS[0], 12)
    stop = greedy[4].token
    requests = _requests(stop)
    want = asyncio.run(_all(local_engine, requests))
    got = asyncio.run(_all(ray_engine, requests))
    assert got == want
    assert len(want[6]) < 12                       # the stop id ended it
    assert want[5][0][1] is not None               # log-probs came back
    assert want[8] == want[0]                      # the repeat is the same answer
    assert ray_engine.stats()["rebuilds"] == NO_REBUILDS


def test_embeddings_from_ray_stages_are_the_in_process_ones(local_engine, ray_engine):
    for pooling in ("mean", "last"):
        want = asyncio.run(local_engine.embed(tuple(PROMPTS[1]), pooling))
        assert torch.equal(asyncio.run(ray_engine.embed(tuple(PROMPTS[1]), pooling)), want)


def test_an_overflowing_temperature_beside_greedy_streams_is_greedy(ray_engine):
    # temperature 1e-40 overflows the scaled logits: the sampler falls back to argmax,
    # and the batch it shares with six greedy streams is unaffected.
    requests = [GenerationRequest(tuple(p), 8) for p in PROMPTS[:6]]
    tiny = GenerationRequest(tuple(PROMPTS[0]), 8, SamplingParams(temperature=1e-40))
    got = asyncio.run(_all(ray_engine, requests + [tiny]))
    assert got[-1] == got[0]
    assert ray_engine.stats()["rebuilds"] == NO_REBUILDS


def test_stage_kills_mid_stream_cost_no_token(ray_engine):
    """SIGKILL a stage of pipeline 0 at a drawn token, three rounds in a row: every stream
    ends with its fault-free tokens and log-probs, the other pipeline never rebuilds, and
    the engine re-creates a stage that Ray stopped restarting (restarts=1)."""
    seed = random.randrange(2**32)
    print(f"stage-kill seed {seed}")
    rng = random.Random(seed)
    # every other one constrained: a rebuilt request's grammar moves past what it made
    requests = [GenerationRequest(tuple(p), 32, SamplingParams(
        logprobs=1, constraint=json_object() if k % 2 else None))
        for k, p in enumerate(PROMPTS)]
    want = asyncio.run(_all(ray_engine, requests))
    before = list(ray_engine.stats()["rebuilds_by_pipeline"])
    for _ in range(3):
        stage, at = rng.randrange(2), rng.randrange(4, 24)
        pid = ray.get(ray_engine.pipelines[0].actors[stage].pid.remote(), timeout=900)

        async def kill_at(request):
            out = []
            async for s in ray_engine.generate(request):
                out.append((s.token, s.logprobs))
                if len(out) == at and request is requests[0]:
                    os.kill(pid, signal.SIGKILL)
            return out

        got = asyncio.run(_gather(kill_at, requests))
        assert got == want, f"seed {seed}"
    after = ray_engine.stats()
    assert after["rebuilds_by_pipeline"][0] > before[0]
    assert after["rebuilds_by_pipeline"][1] == before[1]
    assert after["recreated"] >= 1
    assert asyncio.run(_all(ray_engine, requests[:2])) == want[:2]  # still serving


def test_a_restarted_stage_takes_the_prompt_state_from_the_other_pipeline(ray_engine):
    """A stage killed mid-stream comes back empty; the rebuilt request's stages pull the
    prompt's state from the other pipeline, which served it too, instead of recomputing
    it (the request's own pipeline held the longest prefix, so only the rebuild looks
    elsewhere), and the answer is the fault-free one."""
    prompt = tuple([1] + [(i * 53 + 7) % 30000 + 50 for i in range(300)])
    want = asyncio.run(_collect(ray_engine, GenerationRequest(prompt, 24, pipeline=1)))
    assert asyncio.run(_collect(ray_engine, GenerationRequest(prompt, 24, pipeline=0))) == want
    pid = ray.get(ray_engine.pipelines[0].actors[1].pid.remote(), timeout=900)

    async def killed():
        out = []
        async for s in ray_engine.generate(GenerationRequest(prompt, 24, pipeline=0)):
            out.append((s.token, s.logprobs))
            if len(out) == 4:
                os.kill(pid, signal.SIGKILL)
        return out
    assert asyncio.run(killed()) == want
    stage = ray_engine.pipeline_stats(0)[1]          # the new process
    assert stage["pulls"]["pulls"] >= 1 and stage["pulls"]["pulled_tokens"] >= 256


def test_a_stage_killed_under_speculation_costs_no_token(ray_engine, smollm2):
    """A stream alone, so that its steps verify proposed tokens (a code answer repeats
    its prompt: most are accepted), with a stage killed mid-stream: the rebuilt request
    replays what it made and speculates on, and every token and log-prob is the one
    decoding without speculation and without the fault gives."""
    from skippy.mesh.tokenizer import Tokenizer
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompt = tuple(Tokenizer(smollm2).encode("Repeat this code:\n" + code + "Again:\n"))
    plain = GenerationRequest(prompt, 40, SamplingParams(logprobs=1), pipeline=0,
                              speculate=False)
    want = asyncio.run(_collect(ray_engine, plain))
    fast = dataclasses.replace(plain, speculate=True)
    assert asyncio.run(_collect(ray_engine, fast)) == want
    figures = ray_engine.pipeline_stats(0)[1]["speculation"]
    assert figures["accepted_tokens"] >= 10, figures
    pid = ray.get(ray_engine.pipelines[0].actors[0].pid.remote(), timeout=900)
    before = ray_engine.stats()["rebuilds_by_pipeline"][0]

    async def killed():
        out = []
        async for s in ray_engine.generate(fast):
            out.append((s.token, s.logprobs))
            if len(out) == 15:
                os.kill(pid, signal.SIGKILL)
        return out
    assert asyncio.run(killed()) == want
    assert ray_engine.stats()["rebuilds_by_pipeline"][0] > before


async def _gather(fn, requests):
    return await asyncio.gather(*[fn(r) for r in requests])


def test_a_poisoned_row_fails_only_its_request(smollm2):
    engine = InProcessEngine(smollm2, 2, n_ctx=512, weight_format="int4",
                             cache=CacheConfig(enabled=False))
    # one row per step and lane: a step of proposed tokens would carry the victim's
    # token among others' rows (tests/test_speculation.py covers those steps)
    requests = [GenerationRequest(tuple(p), 10, speculate=False) for p in PROMPTS[:4]]
    want = asyncio.run(_all(engine, requests))
    fed = [[t for t, _ in w[:-1]] for w in want]   # the tokens each request decodes
    k, victim = next((i, t) for i, f in enumerate(fed) for t in f
                     if not any(t in g for j, g in enumerate(fed) if j != i))

    def poison(row):  # the row's request at fault (a plain ValueError would be ours)
        if int(row.x) == victim:
            raise RequestError("poisoned row")
    engine.servers[0].fault = poison

    async def each():
        return await asyncio.gather(*[_collect(engine, r) for r in requests],
                                    return_exceptions=True)
    got = asyncio.run(each())
    assert isinstance(got[k], RequestError)
    assert [g for i, g in enumerate(got) if i != k] == [w for i, w in enumerate(want)
                                                        if i != k]
    stats = engine.stats()
    assert stats["rebuilds"] == NO_REBUILDS         # the request's fault: never retried
    assert stats["stages"][0]["decode_rows"] > stats["stages"][0]["steps"]["decode"]


def test_sixteen_streams_under_evictions_equal_cache_off(smollm2):
    # A byte cap that holds a few entries: recording evicts, yet a planned restore never
    # loses its entry (the plan pinned it), so nothing is rebuilt.
    base = [1] + [(i * 53) % 30000 + 50 for i in range(64)]
    prompts = [base[:1 + 64 * (k % 2)] + [(i * 7 + k * 11) % 30000 + 50
                                         for i in range(70 + 9 * k)] for k in range(16)]
    small = CacheConfig(max_bytes=6 * 2**20, admit_after=1)
    on = InProcessEngine(smollm2, 2, n_ctx=512, weight_format="int4", cache=small,
                         lanes=16)
    off = InProcessEngine(smollm2, 2, n_ctx=512, weight_format="int4",
                          cache=CacheConfig(enabled=False), lanes=16)
    requests = [GenerationRequest(tuple(p), 6) for p in prompts]
    want = asyncio.run(_all(off, requests))
    for _ in range(2):  # the second round hits what the first recorded, or its evictions
        assert asyncio.run(_all(on, requests)) == want
    stats = on.stats()
    assert sum(s["prefix"]["counters"]["evictions"] for s in stats["stages"]) > 0
    assert stats["rebuilds"] == NO_REBUILDS
    assert sum(s.get("restore_failures", 0) for s in stats["stages"]) == 0


def test_thirty_two_requests_of_n_8_get_200s_or_503s_never_500s(ray_engine, smollm2):
    """A burst far beyond the lane budget: each request takes all its lanes at once or
    waits in line, then gets a 503 with Retry-After; stages stay within the plan."""
    import httpx

    from skippy.mesh.front.gateway import BackgroundServer, create_app
    eng = RayEngine(smollm2, 2, model_name="smollm2", n_ctx=8192, weight_format="int4")
    eng.admission.wait_s = 10.0  # the lane queue's wait (30 s by default) is the test's length
    try:
        with BackgroundServer(create_app(eng, api_keys=[])) as srv:
            async def one(c, i):
                return await c.post("/v1/completions", json={
                    "model": "smollm2", "prompt": f"Request {i} says", "n": 8,
                    "max_tokens": 8, "temperature": 0.8, "seed": i})

            async def burst():
                async with httpx.AsyncClient(base_url=srv.url, timeout=600) as c:
                    return await asyncio.gather(*[one(c, i) for i in range(32)])
            answers = asyncio.run(burst())
        codes = [r.status_code for r in answers]
        print(f"32 requests of n=8: {codes.count(200)} x 200, {codes.count(503)} x 503")
        assert set(codes) <= {200, 503}, codes
        assert codes.count(200) >= 2  # the first at once, the next after waiting in line
        assert all(r.headers.get("retry-after") for r in answers if r.status_code == 503)
        assert all(len(r.json()["choices"]) == 8 for r in answers if r.status_code == 200)
        for actor, st in zip(eng.actors, eng.plan.stages):
            peak = ray.get(actor.memory.remote(), timeout=60)["peak_rss"]
            print(f"stage {st.index}: peak RSS {peak >> 20} MiB of {st.total_bytes >> 20}")
            assert peak <= st.total_bytes, (st.index, peak, st.total_bytes)
    finally:
        asyncio.run(eng.close())


# -- the attack -------------------------------------------------------------------------------
def test_slow_sockets_and_big_requests_do_not_stall_health_or_streams(ray_engine):
    """3 streams run; 1,000 sockets send headers a byte a second and one key repeats a
    4 MiB request of large tool schemas (evals/robustness.py): every stream answers, the
    key is refused (400 while its body budget lasts, then 429 unread), no slow socket is
    served, and neither /health nor a stream stalls as they did (1.2-2 s between chunks).
    The issue's figures (/health < 100 ms, < 250 ms between chunks) are the eval's: CI
    runs other tests beside this one on 2 cores."""
    raise_file_limit(4096)  # this process holds the server's ends of the sockets
    with BackgroundServer(create_app(ray_engine, api_keys=[robustness.KEY])) as srv:
        r = robustness.attack(srv.url, "the sea")
    print(f"\n{robustness.line(r)}")
    assert len(r["gaps"]) >= 3 * 30 and len(r["health"]) >= 5 and r["dropped"] == []
    assert set(r["answers"]) == {400, 429}, set(r["answers"])
    # one /health of 15 may wait for the other xdist worker's CPU (571 and 739 ms seen in CI,
    # the rest tens of ms); the stall this guards against held every check for 1.2-2 s
    health = sorted(r["health"])
    assert health[-2] < 0.5 and health[-1] < 1.0 and max(r["gaps"]) < 1.0, robustness.line(r)
