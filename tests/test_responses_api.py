"""OpenAI's Responses API (mesh/front/responses_api.py) as the openai SDK's users call it:
`responses.create` plain and streamed, `previous_response_id` over three turns whose
later turns find the earlier ones cached, retrieve and delete per tenant, errors in the
envelope; and a function-call round trip on a random-weight qwen3 whose template knows
tools (conftest: qwen3_tools). Real uvicorn on loopback: run inside a loopback-only
network namespace."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai_schemas import responses_conform

from skippy.mesh.front.openai_api import ApiError
from skippy.mesh.front.responses_api import ResponseStore, Stored, to_chat
from tool_schemas import WEATHER

KEYS = ("k-one", "k-two")
QUESTION = "What is the capital of France?"


# -- the body a Responses request means -------------------------------------------------------
def test_a_responses_body_becomes_the_chat_it_means():
    before = Stored({"id": "resp_1"}, ({"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello."}))
    turn = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo", "unit": "celsius"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "-3"}]}, before)
    assert turn.chat == {
        "model": "m", "max_tokens": 9, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w",
                                                                   "schema": WEATHER}},
        "messages": [
            {"role": "system", "content": "Be brief."}, *before.conversation,
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3"}]}
    assert turn.history == before.conversation  # the instructions are not kept


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text"),
])
def test_what_a_body_cannot_mean_is_a_400_naming_its_field(body, param):
    with pytest.raises(ApiError) as e:
        to_chat(body, None)
    assert e.value.status == 400 and e.value.param == param


def test_the_store_keeps_each_tenants_own_and_drops_its_oldest():
    store = ResponseStore(per_tenant=2)
    for i in range(3):
        store.put("a", Stored({"id": f"r{i}"}, ()))
    store.put("b", Stored({"id": "rb"}, ()))
    assert store.get("a", "r2").response == {"id": "r2"}
    for tenant, rid in (("a", "r0"), ("b", "r1"), ("a", "rb")):
        with pytest.raises(ApiError) as e:
            store.get(tenant, rid)
        assert e.value.status == 404


def test_the_store_bounds_each_tenants_bytes():
    turn = ({"role": "user", "content": "x" * 1000},)
    store = ResponseStore(bytes_per_tenant=3500)
    for i in range(5):  # ~1 KB each: the oldest go once a tenant holds over 3.5 KB
        store.put("a", Stored({"id": f"r{i}"}, turn))
    store.put("b", Stored({"id": "rb"}, turn * 3))
    assert store.get("a", "r4") and store.get("a", "r2") and store.get("b", "rb")
    with pytest.raises(ApiError):
        store.get("a", "r1")
    store.delete("a", "r4")
    store.put("a", Stored({"id": "big"}, turn * 9))  # over the bound alone: not kept,
    with pytest.raises(ApiError):                     # and the others stay
        store.get("a", "big")
    assert store.get("a", "r2") and store.get("a", "r3")


# -- SmolLM2 over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2",
                             weight_format="int4")
    with BackgroundServer(create_app(engine, api_keys=list(KEYS))) as srv:
        yield srv.url + "/v1"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key=KEYS[0], max_retries=0)


def test_create_answers_what_the_chat_api_answers(client):
    r = client.responses.create(model="smollm2", instructions="Be brief.", input=QUESTION,
                                max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=24, temperature=0, extra_body={"cache_salt": "other"},
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smollm2"
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_three_turns_by_previous_response_id_find_the_earlier_ones_cached(client):
    turns, previous = [], None
    for text in ("My name is Ada. What is the capital of France?", "And of Italy?",
                 "What is my name?"):
        r = client.responses.create(model="smollm2", input=text, max_output_tokens=16,
                                    temperature=0, previous_response_id=previous)
        turns.append(r)
        previous = r.id
    for before, after in zip(turns, turns[1:]):
        assert after.previous_response_id == before.id
        # the last prompt and its reply come back unchanged: the stages hold them
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens
        assert after.usage.input_tokens > before.usage.input_tokens + \
            before.usage.output_tokens


def test_a_stream_gives_the_response_create_gives(client):
    ask = dict(model="smollm2", instructions="Be brief.", input=QUESTION,
               max_output_tokens=32, temperature=0)
    whole = client.responses.create(**ask)
    assert whole.status == "completed"
    kinds = [e.type for e in client.responses.create(**ask, stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    with client.responses.stream(**ask) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stored_responses_are_each_tenants_own(client, url):
    r = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=4,
                                temperature=0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    other = openai.OpenAI(base_url=url, api_key=KEYS[1], max_retries=0)
    for call in (lambda: other.responses.retrieve(r.id),
                 lambda: other.responses.create(model="smollm2", input="Hi",
                                                previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{r.id}' not found."
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=2,
                                       temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_bad_body_is_a_400_in_the_envelope(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input=[{"type": "computer_call"}])
    assert e.value.body["param"] == "input"


# -- OpenAI's published schemas --------------------------------------------------------------------
def test_responses_and_their_events_match_openais_schemas(url):
    responses_conform(url, {"model": "smollm2", "input": QUESTION, "instructions": "Be brief.",
                        "max_output_tokens": 32, "temperature": 0}, KEYS[0])
    responses_conform(url, {"model": "smollm2", "input": QUESTION, "max_output_tokens": 3,
                        "temperature": 0}, KEYS[0])  # incomplete
    # null is "not given": the response still says the defaults (schemathesis found it)
    responses_conform(url, {"model": "smollm2", "input": QUESTION, "max_output_tokens": 3,
                        "temperature": 0, "parallel_tool_calls": None, "tool_choice": None,
                        "store": None, "text": None, "metadata": None}, KEYS[0])


# -- a function-call round trip -------------------------------------------------------------------
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER}]


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_a_function_call_and_its_output_round_trip(qwen3_tools_url, streamed):
    client = openai.OpenAI(base_url=qwen3_tools_url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="qwen3-tools", input="How warm is it in Oslo?", tools=TOOLS,
               tool_choice={"type": "function", "name": "get_weather"},
               max_output_tokens=64, temperature=0)
    if streamed:
        with client.responses.stream(**ask) as stream:
            r = stream.get_final_response()
    else:
        r = client.responses.create(**ask)
    if streamed:  # the whole call and its events, as OpenAI's schemas publish them
        responses_conform(qwen3_tools_url + "/v1", {**ask, "tools": TOOLS})
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model="qwen3-tools", previous_response_id=r.id, tools=TOOLS, tool_choice="none",
        max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}])
    assert not [item for item in answer.output if item.type == "function_call"]
    # the call came back into the prompt (this server runs without caches)
    assert answer.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
