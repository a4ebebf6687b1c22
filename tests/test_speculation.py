"""Exact speculative decoding (mesh/control/speculation.py, the verify step in
mesh/stage/session.py): with speculation on, every token, log-prob and logits row is
bitwise what decoding without it gives, greedy and seeded, through 1 and 2 stages, for a
dense family (SmolLM2) and a hybrid one (LFM2: recurrent state rewound inside a verify
step), whatever the proposals are: besides prompt lookup's own, a proposer that knows the
answer and is wrong on purpose every third token puts rejections at every position of a
step. Over HTTP, the
gateway's requests (n choices, stop strings, penalties, logprobs, a json_schema) answer
the same with a speculating engine as without. The proposer and its k policy have unit
tests of their own.
"""

from __future__ import annotations

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control import driver
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.control.speculation import MAX_PROPOSED, PromptLookup, Speculator, StepCosts
from skippy.mesh.sampler import SamplingParams
from skippy.mesh.tokenizer import Tokenizer

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\n")
PROMPT = "Repeat this code exactly:\n" + CODE + "\nHere it is again:\n"


# -- the proposer ---------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    lookup = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    assert lookup.propose(2) == [5, 6]       # "2 3" last followed by 5 6 (not 4)
    lookup.extend([4])
    assert lookup.propose(3) == [9, 2, 3]    # "2 3 4" matched before the shorter "3 4"
    assert lookup.propose(0) == []
    assert PromptLookup([1, 2, 3]).propose(4) == []  # no n-gram of 2 repeats


def test_the_number_proposed_follows_what_was_accepted():
    spec = Speculator([5, 6, 7, 8] * 4)
    assert len(spec.propose([], room=100)) == 4   # FIRST_K
    spec.observe(4, 4)
    assert spec.k == 8 and len(spec.propose([], room=100)) == 8
    assert len(spec.propose([], room=3)) == 3     # never past max_tokens
    spec.observe(8, 8)
    assert spec.k == MAX_PROPOSED
    spec.observe(8, 2)
    assert spec.k == 3
    spec.observe(3, 0)                            # a miss: a pause, then k = 1
    assert spec.propose([], room=100) == []
    assert len(spec.propose([], room=100)) == 1
    spec.observe(1, 0)                            # two misses: a longer pause
    assert [spec.propose([], room=100) for _ in range(3)] == [[], [], []]


def costs(step_ms: float, row_ms: float) -> StepCosts:
    c = StepCosts()
    c.observe_step(1, step_ms / 1e3)
    c.observe_step(5, (step_ms + 4 * row_ms) / 1e3)
    return c


def test_k_maximizes_expected_tokens_per_second_of_the_measured_costs():
    assert StepCosts().best_k(0.9, 8) is None               # nothing measured yet
    far = costs(step_ms=30.0, row_ms=1.0)                   # hops dominate: long runs
    assert far.best_k(0.9, 8) == 8 and far.best_k(0.5, 8) >= 4
    near = costs(step_ms=5.0, row_ms=4.0)                   # a row costs nearly a step
    assert near.best_k(0.9, 8) >= 1 and near.best_k(0.3, 8) == 0
    # the choice is the best of every k by the formula (1 + a + .. + a^k) / (step + k row)
    a = 0.7
    rates = [sum(a ** i for i in range(k + 1)) / (5.0 + 2.0 * k) for k in range(9)]
    assert costs(5.0, 2.0).best_k(a, 8) == rates.index(max(rates))
    drafted = costs(5.0, 0.5)
    drafted.observe_draft(4, 0.008)                         # a draft's 2 ms a proposal
    assert drafted.best_k(0.5, 8) < costs(5.0, 0.5).best_k(0.5, 8)


def test_a_request_takes_k_from_its_pipelines_costs():
    far = Speculator([5, 6, 7, 8] * 4, costs=costs(step_ms=30.0, row_ms=1.0))
    far.observe(4, 4)
    assert far.k == 8                                       # runs taken whole, hops dear
    near = Speculator([5, 6, 7, 8] * 4, costs=costs(step_ms=5.0, row_ms=4.0))
    near.observe(4, 1)                                      # a = 1/2 after this step
    assert near.k == 1 and near.propose([], room=100) == []  # no k pays: held back
    assert len(near.propose([], room=100)) == 1             # then one again


# -- exactness through the stages -----------------------------------------------------------
class Oracle(Speculator):
    """Proposes the run's own continuation (`truth`: the tokens decoding without
    proposals gave, after `prompt` tokens) with every third token made wrong, so that
    verify steps accept runs and reject at every position of a step."""

    truth: list[int] = []
    prompt = 0
    calls = 0

    def propose(self, context_tail, room):
        super().propose(context_tail, room)
        at = len(self.lookup.tokens) - Oracle.prompt
        out = Oracle.truth[at:at + min(room, 4)]
        Oracle.calls += 1
        return [t if (i + Oracle.calls) % 3 else (t + 1) % 1000 for i, t in enumerate(out)]


def _runs(engine, prompt, sampling, max_tokens=40):
    off = engine.complete(prompt, max_tokens, sampling=sampling, speculate=False,
                          logits=True)
    Oracle.truth, Oracle.prompt = [s.token for s in off], len(prompt)
    return {False: off, True: engine.complete(prompt, max_tokens, sampling=sampling,
                                              speculate=True, logits=True)}


def _same(runs) -> None:
    off, on = runs[False], runs[True]
    assert [s.token for s in on] == [s.token for s in off]
    assert [s.logprobs for s in on] == [s.logprobs for s in off]
    for a, b in zip(off, on):
        assert a.logits is not None and b.logits is not None
        assert a.logits.numpy().tobytes() == b.logits.numpy().tobytes()


SAMPLINGS = [SamplingParams(temperature=0.0, logprobs=3),
             SamplingParams(temperature=0.9, seed=11, top_k=40, logprobs=2,
                            presence_penalty=0.3)]


@pytest.mark.parametrize("family,stages", [("smollm2", 1), ("smollm2", 2), ("lfm2", 2)])
@pytest.mark.parametrize("proposer", ["lookup", "oracle"])
def test_speculation_gives_the_same_tokens_logprobs_and_logits(family, stages, proposer,
                                                               request, monkeypatch):
    path = request.getfixturevalue("smollm2" if family == "smollm2" else "lfm2_f32")
    if proposer == "oracle":
        monkeypatch.setattr(driver, "Speculator", Oracle)
    engine = InProcessEngine(path, stages, weight_format="int4",
                             cache=CacheConfig(enabled=False))
    prompt = tuple(Tokenizer(path).encode(PROMPT))
    for sampling in SAMPLINGS:
        _same(_runs(engine, prompt, sampling))
    figures = engine.servers[-1].speculation
    if proposer == "oracle":  # runs accepted, and rejections at several positions
        assert 0 < figures["accepted_tokens"] < figures["proposed_tokens"], figures
    elif family == "smollm2":  # its answer repeats the prompt's code: lookup finds it
        assert figures["accepted_tokens"] > 10, figures


def test_a_verify_step_never_runs_past_max_tokens_or_the_stop(smollm2):
    engine = InProcessEngine(smollm2, 2, weight_format="int4",
                             cache=CacheConfig(enabled=False))
    prompt = tuple(Tokenizer(smollm2).encode(PROMPT))
    for n in (1, 2, 5, 17):
        runs = _runs(engine, prompt, SamplingParams(temperature=0.0), max_tokens=n)
        assert len(runs[True]) == len(runs[False]) == n
        assert [s.token for s in runs[True]] == [s.token for s in runs[False]]
    stop = engine.complete(prompt, 30, speculate=False)[12].token
    runs = {spec: engine.complete(prompt, 30, speculate=spec, stop_ids=frozenset({stop}))
            for spec in (False, True)}
    assert [s.token for s in runs[True]] == [s.token for s in runs[False]]
    assert stop not in [s.token for s in runs[True]]


def test_a_requests_choices_speculate_side_by_side(smollm2):
    """n choices of one request (siblings) verify proposals side by side (two requests
    of their own would not, while both decode: their rows batch already); the tokens
    are the same either way."""
    import asyncio
    import dataclasses
    from skippy.mesh.control.engine import GenerationRequest
    engine = InProcessEngine(smollm2, 2, weight_format="int4",
                             cache=CacheConfig(enabled=False))
    prompt = tuple(Tokenizer(smollm2).encode(PROMPT))
    one = GenerationRequest(prompt, 32, speculate=True)

    async def together(requests):
        async def run(r):
            return [s.token async for s in engine.generate(r)]
        return await asyncio.gather(*(run(r) for r in requests))
    want = [s.token for s in engine.complete(prompt, 32, speculate=False)]
    got = asyncio.run(together([dataclasses.replace(one, siblings=2)] * 2))
    assert got == [want, want]
    assert engine.servers[-1].speculation["accepted_tokens"] > 10


# -- a draft model as the proposer ----------------------------------------------------------
@pytest.fixture(scope="module")
def llama_draft(smollm2, tmp_path_factory):
    """A 2-layer random-weight llama of SmolLM2's vocabulary: a draft whose proposals
    are mostly wrong."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("draft") / "llama-draft-L2.gguf"
    return write_synthetic("llama", layers=2, seed=5, out=out, tokenizer_from=smollm2)


@pytest.mark.parametrize("draft", ["itself", "random"])
def test_a_draft_model_proposes_and_the_answer_stays_the_same(smollm2, llama_draft, draft):
    engine = InProcessEngine(smollm2, 2, weight_format="int4",
                             cache=CacheConfig(enabled=False),
                             draft=smollm2 if draft == "itself" else llama_draft)
    prompt = tuple(Tokenizer(smollm2).encode("Write a short story about a robot."))
    for sampling in SAMPLINGS:
        _same(_runs(engine, prompt, sampling, max_tokens=24))
    figures = engine.servers[-1].speculation
    assert figures["verify_steps"] > 0, figures
    if draft == "itself":  # the same weights in one stage: its greedy tokens mostly hold
        assert figures["accepted_tokens"] >= figures["proposed_tokens"] // 2, figures


def test_a_draft_of_another_vocabulary_is_refused(smollm2, gemma3):
    from skippy.topology.errors import UserError
    with pytest.raises(UserError, match="another vocabulary"):
        InProcessEngine(smollm2, 1, weight_format="int4", draft=gemma3)


# -- over HTTP ------------------------------------------------------------------------------
BODIES = [
    {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "logprobs": 2},
    {"prompt": PROMPT, "max_tokens": 48, "temperature": 0.8, "seed": 3, "n": 2,
     "frequency_penalty": 0.5, "stop": ["mul"]},
    {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
     "temperature": 0, "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "Give the code's function names as JSON:\n"
                   + CODE}], "max_tokens": 40, "temperature": 0,
     "response_format": {"type": "json_schema", "json_schema": {"name": "names", "schema": {
         "type": "object", "properties": {"names": {"type": "array",
                                                    "items": {"type": "string"}}},
         "required": ["names"]}}}},
]


def test_gateway_answers_are_the_same_with_speculation_on_and_off(smollm2):
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    answers = {}
    for spec in (False, True):
        engine = InProcessEngine(smollm2, 2, weight_format="int4", model_name="smollm2",
                                 cache=CacheConfig(enabled=False), speculate=spec)
        with BackgroundServer(create_app(engine, api_keys=())) as srv:
            out = []
            for body in BODIES:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = httpx.post(srv.url + path, json={"model": "smollm2", **body}, timeout=120)
                assert r.status_code == 200, r.text
                answer = r.json()
                out.append([(c.get("text") or c["message"]["content"], c["finish_reason"],
                             c.get("logprobs")) for c in answer["choices"]])
            answers[spec] = out
            figures = engine.servers[-1].speculation
        if spec:
            assert figures["verify_steps"] > 0, figures
    assert answers[True] == answers[False]


def test_the_pipeline_bench_runs_and_its_answers_agree(corpus, tmp_path):
    from skippy.evals import bench_speculation
    out = bench_speculation.main(["--stages", "2", "--hop-ms", "1", "--tokens", "24",
                                  "--records", "1", "--use-case", "code_refinement",
                                  "--json", str(tmp_path / "spec.json")])
    run, = out["runs"]
    assert run["same"] and run["on"][0]["tokens"] == 23  # the decode steps' (after the first)
    assert run["on"][0]["steps"] < run["off"][0]["steps"]  # its code answer repeats
    assert run["predicted_ms"] > 0 and run["measured_ms"] > 0
