"""Whatever a client sends, the gateway answers in its API's terms: generated bodies shaped
like OpenAI's (valid, near-valid and broken) against both endpoints over real HTTP get a
200 or a 4xx in the error envelope (a 503 with Retry-After only over capacity), never a
500 nor a dropped connection, and every body (each streamed chunk too) matches OpenAI's
published schema (tests/openai_schemas.py). Real SmolLM2 in 2 stages behind real uvicorn,
and for tool calls a random-weight qwen3 whose template writes them itself (SmolLM2's is
told them: generic_tools); run inside a loopback-only network namespace (see the
Makefile)."""

from __future__ import annotations

import asyncio

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai_schemas import conforms

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app

JSON = {"Content-Type": "application/json"}

# -- what clients send ----------------------------------------------------------------------------
def good_or(good, bad=None, one_in: int = 12):
    """Mostly `good`, now and then `bad` (by default any JSON value): most generated
    requests are valid, and most invalid ones are wrong in one place."""
    bad = JUNK if bad is None else bad
    return st.integers(1, one_in).flatmap(lambda i: bad if i == one_in else good)


# text, now and then with a lone surrogate (JSON's \ud800 escapes spell them)
SURROGATE = st.builds(lambda a, s, b: a + s + b, st.text(max_size=3),
                      st.characters(categories=["Cs"]), st.text(max_size=3))
TEXT = good_or(st.text(max_size=12) | st.sampled_from(
    ["Hello", "The sky is", "<|im_start|>", "<|endoftext|>", "\u00e9\u4e16", "\U0001f600", ""]),
    SURROGATE, one_in=8)
JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), SURROGATE),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)
NOT_NULL = JUNK.filter(lambda v: v is not None)  # null would mean "absent"
UNIT = st.floats(0, 2, allow_nan=False) | st.sampled_from([0, 1, 1e-40, 1e-300, -0.0])


# -- tools and response formats ---------------------------------------------------------------------
NAMES = st.sampled_from(["get_weather", "add", "f-1"])
PARAMETERS = st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
     "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}},
    {"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}},
     "required": ["q"], "additionalProperties": False},
    {"type": "object", "properties": {}, "additionalProperties": False}])
# now and then: invalid, one the grammar engine refuses, or unbounded (any object)
ODD_PARAMETERS = st.sampled_from([{"type": "strin"}, [], {"type": "string", "pattern": "(?<=a)b"},
                                  {}, {"type": "object"}])
PLAIN = st.sampled_from(["Hello", "Weather in Paris?", "\u00e9\u4e16", ""]) | st.text(max_size=12)


def tool_fields(one_in: int) -> dict:
    """Strategies for tools, tool_choice and tool turns in the history, each field wrong
    about once in `one_in` (rarely, where a request holds many of them)."""
    def ok(good, bad=None):
        return good_or(good, bad, one_in)

    tool = st.fixed_dictionaries(
        {"type": ok(st.just("function"), st.sampled_from(["custom", None])),
         "function": ok(st.fixed_dictionaries(
             {"name": ok(NAMES, st.text(max_size=70)),
              "parameters": ok(PARAMETERS, ODD_PARAMETERS | JUNK)},
             optional={"description": ok(PLAIN, TEXT), "strict": ok(st.booleans())}))})
    call = st.fixed_dictionaries({"id": ok(st.just("call_1")), "type": st.just("function"),
                                  "function": ok(st.fixed_dictionaries(
                                      {"name": ok(NAMES), "arguments": ok(st.sampled_from(
                                          ['{"city": "Paris"}', "{}", "not json", "[1]"]))}))})
    turn = st.one_of(
        st.fixed_dictionaries({"role": st.just("assistant"), "content": ok(st.none() | PLAIN),
                               "tool_calls": ok(st.lists(call, max_size=2))}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": ok(PLAIN),
                               "tool_call_id": ok(st.just("call_1"))}))
    return {"tools": ok(st.lists(tool, max_size=3, unique_by=lambda t: str(t["function"]))
                        .filter(bool), NOT_NULL),
            "tool_choice": ok(st.sampled_from(["auto", "none", "required"]) | NAMES.map(
                lambda name: {"type": "function", "function": {"name": name}})),
            "parallel_tool_calls": ok(st.booleans()),
            "turn": turn}


TOOL_FIELDS = tool_fields(12)
RESPONSE_FORMAT = good_or(st.sampled_from([
    {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [1, "a"]}}},
    {"type": "json_schema", "json_schema": {"name": "no name!"}}]))

SAMPLING = {
    "temperature": good_or(UNIT),
    "top_p": good_or(st.floats(0.01, 1) | st.just(1)),
    "top_k": good_or(st.integers(-1, 60)),
    "seed": good_or(st.integers(-2**63, 2**64 - 1)),
    "presence_penalty": good_or(st.floats(-2, 2)),
    "frequency_penalty": good_or(st.floats(-2, 2)),
    "logit_bias": good_or(st.dictionaries(st.integers(0, 49151).map(str),
                                          st.floats(-100, 100), max_size=4)),
    "stop": good_or(st.one_of(TEXT, st.lists(TEXT, max_size=4))),
    "stream": good_or(st.booleans()),
    "stream_options": good_or(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "cache_salt": good_or(st.text(max_size=300)),
    "response_format": RESPONSE_FORMAT,
    "tools": TOOL_FIELDS["tools"],
    "tool_choice": TOOL_FIELDS["tool_choice"],
    "parallel_tool_calls": TOOL_FIELDS["parallel_tool_calls"],
    "user": TEXT,
    "n": good_or(st.integers(1, 3), NOT_NULL),
}
PROMPT = st.one_of(TEXT, st.lists(st.integers(-5, 60000), max_size=6),
                   st.lists(TEXT, min_size=1, max_size=3), NOT_NULL)
MESSAGE = st.fixed_dictionaries(
    {"role": good_or(st.sampled_from(["system", "user", "assistant"])),
     "content": good_or(TEXT | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2))})
MESSAGES = good_or(st.lists(MESSAGE | TOOL_FIELDS["turn"], min_size=1, max_size=3), NOT_NULL)
# requests with tools are mostly right: they go deep (rendering, a forced call, parsing)
RARE = tool_fields(40)
TOOL_MESSAGES = good_or(st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user"]), "content": PLAIN}) | RARE["turn"],
    min_size=1, max_size=3), NOT_NULL, one_in=40)
# always a small limit: no generated request may run to its default of 256 tokens
MAX_TOKENS = good_or(st.integers(1, 4), st.integers(-3, 0) | st.integers(10**5, 10**9)
                     | NOT_NULL)


@st.composite
def requests(draw, model: str = "smollm2", tools: bool = False) -> tuple[str, bytes, dict]:
    """(path, raw body, headers): a body shaped like OpenAI's, sometimes with a wrong
    field, sometimes mangled on the wire or sent without its Content-Type. `tools`:
    a chat request that offers tools, most of the time."""
    chat = tools or draw(st.booleans())
    body: dict = {"model": draw(good_or(st.just(model), SURROGATE | TEXT | NOT_NULL,
                                        one_in=40 if tools else 6)),
                  "max_tokens": draw(MAX_TOKENS if not tools else good_or(
                      st.integers(1, 64), NOT_NULL, 40))}  # a whole call takes ~40 tokens
    if tools:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            body[name] = draw(RARE[name])
    if chat:
        body["messages"] = draw(TOOL_MESSAGES if tools else MESSAGES)
        if draw(st.integers(0, 3 if tools else 1)) == 1:
            body["logprobs"] = draw(good_or(st.booleans()))
            body["top_logprobs"] = draw(good_or(st.integers(0, 3)))
    else:
        body["prompt"] = draw(PROMPT)
        if draw(st.booleans()):
            body["logprobs"] = draw(good_or(st.integers(0, 3)))
    fields = sorted(set(SAMPLING) - (set(RARE) if tools else set()))
    for name in draw(st.sets(st.sampled_from(fields), max_size=3 if tools else 6)):
        body[name] = draw(SAMPLING[name])
    raw = json.dumps(body, allow_nan=True).encode()  # NaN, Infinity; \ud800 escapes
    raw = draw(good_or(st.just(raw), st.sampled_from([raw[: len(raw) // 2], b"[" * 100_000])
                       | st.binary(max_size=20)))
    headers = draw(good_or(st.just(JSON), st.sampled_from([{}, {"Content-Type": "text/plain"}])))
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw, headers


# -- the server --------------------------------------------------------------------------------------
def serving(path, name: str):
    # the context bodies need is short: the planner asks this machine for no more memory
    # than that (8,192 x 8 lanes wanted 2.97 GiB free, and a busy CI machine had 2.11)
    engine = InProcessEngine(path, 2, cache=CacheConfig(), model_name=name, weight_format="int4",
                             n_ctx=2048)
    try:
        with BackgroundServer(create_app(engine, api_keys=())) as srv:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                yield c
    finally:
        asyncio.run(engine.close())


@pytest.fixture(scope="module")
def client(smollm2):
    yield from serving(smollm2, "smollm2")


@pytest.fixture(scope="module")
def tools_client(qwen3_tools):
    yield from serving(qwen3_tools, "qwen3-tools")


def outcome(r: httpx.Response) -> str:
    if r.status_code == 200 or not r.headers["content-type"].startswith("application/json"):
        return str(r.status_code)
    return f"{r.status_code} {r.json()['error']['param']}"


def check_answer(r: httpx.Response, path: str) -> None:
    chat = path.endswith("/chat/completions")
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
            events = [json.loads(e[6:]) for e in r.text.split("\n\n")[:-2] if e]
            errors = [e["error"] for e in events if "error" in e]
            assert all(e["type"] == "invalid_request_error" for e in errors), errors
            for e in events:  # completions' chunks have no published schema
                if "error" in e:
                    conforms("ErrorResponse", e)
                elif chat:
                    conforms("CreateChatCompletionStreamResponse", e)
        else:
            assert r.json()["choices"]
            conforms("CreateChatCompletionResponse" if chat else "CreateCompletionResponse",
                     r.json())
        return
    if r.status_code == 503:
        assert int(r.headers["Retry-After"]) >= 1
    else:
        assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    conforms("ErrorResponse", r.json())


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_any_body_gets_a_200_or_a_4xx_in_the_envelope(client, request):
    path, raw, headers = request
    r = client.post(path, content=raw, headers=headers)  # a dropped connection raises
    event(outcome(r))  # --hypothesis-show-statistics: how the answers spread
    check_answer(r, path)


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests(model="qwen3-tools", tools=True))
def test_any_body_with_tools_gets_a_200_or_a_4xx_in_the_envelope(tools_client, request):
    path, raw, headers = request
    r = tools_client.post(path, content=raw, headers=headers)
    event(outcome(r))
    if r.status_code == 200 and r.headers["content-type"].startswith("application/json"):
        event(f"finish_reason {r.json()['choices'][0]['finish_reason']}")
    check_answer(r, path)


# -- the Responses, Messages and embeddings APIs -----------------------------------------------------------
ITEM = st.one_of(
    st.fixed_dictionaries({"role": good_or(st.sampled_from(["user", "developer", "assistant"])),
                           "content": good_or(TEXT | st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "input_image"]),
                                "text": TEXT}), max_size=2))},
                          optional={"type": good_or(st.just("message"))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": good_or(NAMES),
                           "name": good_or(NAMES), "arguments": good_or(st.just("{}"))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": good_or(NAMES), "output": good_or(PLAIN)}),
    st.fixed_dictionaries({"type": good_or(st.sampled_from(["reasoning", "item_reference"]))}))
FLAT_TOOL = st.fixed_dictionaries({"type": good_or(st.just("function")), "name": good_or(NAMES),
                                   "parameters": good_or(PARAMETERS, ODD_PARAMETERS | JUNK)})
RESPONSES = {
    "instructions": good_or(PLAIN), "temperature": good_or(UNIT), "top_p": good_or(UNIT),
    "stream": good_or(st.booleans()), "store": good_or(st.booleans()),
    "tools": good_or(st.lists(FLAT_TOOL, max_size=2)),
    "tool_choice": good_or(st.sampled_from(["auto", "none", "required"]) | NAMES.map(
        lambda name: {"type": "function", "name": name})),
    "text": good_or(st.sampled_from([{"format": {"type": "text"}},
                                     {"format": {"type": "json_object"}},
                                     {"format": {"type": "json_schema", "name": "a",
                                                 "schema": {"enum": [1, 2]}}}])),
    "previous_response_id": good_or(st.just("resp_unknown")), "metadata": JUNK}
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": good_or(TEXT)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": good_or(NAMES),
                           "name": good_or(NAMES), "input": good_or(st.just({}))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": good_or(NAMES),
                           "content": good_or(PLAIN)}),
    st.fixed_dictionaries({"type": good_or(st.sampled_from(["image", "thinking"]))}))
MESSAGES_API = {
    "system": good_or(PLAIN | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": PLAIN}), max_size=2)),
    "temperature": good_or(UNIT), "top_k": good_or(st.integers(0, 50)),
    "stop_sequences": good_or(st.lists(TEXT, max_size=2)), "stream": good_or(st.booleans()),
    "tools": good_or(st.lists(st.fixed_dictionaries(
        {"name": good_or(NAMES), "input_schema": good_or(PARAMETERS, ODD_PARAMETERS | JUNK)}),
        max_size=2)),
    "tool_choice": good_or(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                            {"type": "tool", "name": "add"}])),
    "output_config": good_or(st.just({"format": {"type": "json_schema",
                                                 "schema": {"enum": ["a", "b"]}}}))}


@st.composite
def agent_requests(draw) -> tuple[str, dict]:
    """(path, body) for /v1/responses, /v1/messages or /v1/embeddings, most fields
    right."""
    api = draw(st.sampled_from(["responses", "messages", "embeddings"]))
    if api == "embeddings":
        body = {"model": draw(good_or(st.just("smollm2"))), "input": draw(good_or(
            TEXT | st.lists(TEXT, min_size=1, max_size=3)
            | st.lists(st.integers(-5, 60000), min_size=1, max_size=6)))}
        for name, value in (("encoding_format", st.sampled_from(["float", "base64"])),
                            ("pooling", st.sampled_from(["mean", "last"]))):
            if draw(st.booleans()):
                body[name] = draw(good_or(value))
        return "/v1/embeddings", body
    if api == "responses":
        body = {"model": draw(good_or(st.just("smollm2"))),
                "max_output_tokens": draw(MAX_TOKENS),
                "input": draw(good_or(TEXT | st.lists(ITEM, min_size=1, max_size=3)))}
        fields, path = RESPONSES, "/v1/responses"
    else:
        turn = st.fixed_dictionaries({"role": good_or(st.sampled_from(["user", "assistant"])),
                                      "content": good_or(TEXT | st.lists(BLOCK, max_size=2))})
        body = {"model": draw(good_or(st.just("smollm2"))), "max_tokens": draw(MAX_TOKENS),
                "messages": draw(good_or(st.lists(turn, min_size=1, max_size=3)))}
        fields, path = MESSAGES_API, "/v1/messages"
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=4)):
        body[name] = draw(fields[name])
    return path, body


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=agent_requests())
def test_the_newer_apis_answer_any_body_with_a_200_or_a_4xx_in_their_envelope(client,
                                                                              request):
    path, body = request
    r = client.post(path, content=json.dumps(body, allow_nan=True).encode(), headers=JSON)
    event(f"{path} {r.status_code}")
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
            assert kinds and "error" not in kinds, r.text[-500:]
            assert kinds[-1] in (("message_stop",) if path == "/v1/messages" else
                                 ("response.completed", "response.incomplete"))
        else:
            assert r.json()["type" if path == "/v1/messages" else "object"] in (
                "message", "response", "list")
        return
    assert 400 <= r.status_code < 500 or (r.status_code == 503 and r.headers["Retry-After"])
    if path == "/v1/messages":
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] and err["error"]["message"]
    else:
        assert r.json()["error"]["message"]
