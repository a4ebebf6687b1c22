"""Anthropic's Messages API (mesh/front/anthropic_api.py) as the `anthropic` SDK's users
call it: `messages.create`, `messages.stream`, `messages.count_tokens`, stop sequences,
usage with cache reads, errors in Anthropic's envelope, keys by `x-api-key`; and a tool
round trip (a forced tool_use, its tool_result sent back) on a random-weight qwen3 whose
template knows tools (conftest: qwen3_tools). Real uvicorn on loopback: run inside a
loopback-only network namespace."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from skippy.mesh.front.anthropic_api import to_chat
from skippy.mesh.front.openai_api import ApiError
from tool_schemas import ADD, WEATHER

anthropic = pytest.importorskip("anthropic")

KEY = "sesame"
# The SDK no longer offers sampling settings (Anthropic's newer models fix them); older
# clients send temperature, and the API takes it, as here through extra_body.
GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# -- the body a Messages request means --------------------------------------------------------
def test_a_messages_body_becomes_the_chat_it_means():
    chat = to_chat({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 3,
        "tools": [{"name": "add", "description": "Sum.", "input_schema": ADD}],
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "easy", "signature": "s"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "add",
                 "input": {"a": 2, "b": 3}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                {"type": "text", "text": "And now?"}]}]})
    assert chat == {
        "model": "m", "max_tokens": 9, "temperature": 0.5, "top_k": 3, "stop": ["\n\n"],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": ADD,
                                                     "description": "Sum."}}],
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "Calling.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
            {"role": "user", "content": "And now?"}]}
    assert to_chat({"model": "m", "max_tokens": 1, "messages": QUESTION,
                    "tool_choice": {"type": "any"}})["tool_choice"] == "required"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": QUESTION}, "max_tokens"),
    ({"model": "m", "max_tokens": "9", "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 9, "messages": QUESTION}, "model"),
    ({"model": "m", "max_tokens": 9, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 9, "messages": [{"role": "system", "content": "x"}]},
     "messages[0]"),
    ({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": ""}}]}]}, "messages[0].content"),
    ({"model": "m", "max_tokens": 9, "messages": QUESTION, "tool_choice": {"type": "x"}},
     "tool_choice"),
    ({"model": "m", "max_tokens": 9, "messages": QUESTION, "stop_sequences": "x"},
     "stop_sequences"),
])
def test_what_a_body_cannot_mean_is_a_400_naming_its_field(body, param):
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and e.value.param == param


# -- SmolLM2 over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2",
                             weight_format="int4")
    with BackgroundServer(create_app(engine, api_keys=[KEY])) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def test_create_answers_what_the_chat_api_answers(client, url):
    m = client.messages.create(model="smollm2", max_tokens=12, system="Be brief.",
                               messages=QUESTION, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "smollm2"
    assert m.id.startswith("msg_") and m.stop_reason in ("end_turn", "max_tokens")
    [block] = m.content
    chat = httpx.post(url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}, json={
                          "model": "smollm2", "max_tokens": 12, "temperature": 0,
                          "messages": [{"role": "system", "content": "Be brief."}, *QUESTION],
                          "cache_salt": "another namespace"}).json()
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    prompt = chat["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model="smollm2", system="Be brief.",
                                           messages=QUESTION)
    assert counted.input_tokens == prompt
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_a_repeat_reads_its_prompt_from_the_cache(client):
    ask = dict(model="smollm2", max_tokens=3, messages=[
        {"role": "user", "content": "Tell me about the river Loire and its castles."}])
    sampled = {"extra_body": {"temperature": 0.7, "top_k": 5}}
    first = client.messages.create(**ask, **sampled)
    again = client.messages.create(**ask, **sampled)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_read_input_tokens < prompt - 8  # the template's head at most
    assert again.usage.cache_read_input_tokens >= prompt - 1  # all but the row it samples
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt


def test_a_stop_sequence_ends_the_text_and_is_named(client):
    whole = client.messages.create(model="smollm2", max_tokens=16, messages=QUESTION,
                                   **GREEDY).content[0].text
    word = whole.split()[2]
    m = client.messages.create(model="smollm2", max_tokens=16, messages=QUESTION,
                               stop_sequences=["zzqx", word], **GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == whole[:whole.index(word)]


def test_stream_gives_the_same_message_as_create(client):
    ask = dict(model="smollm2", max_tokens=10, **GREEDY,
               messages=[{"role": "user", "content": "Name three colours."}])
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_structured_output_follows_its_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    m = client.messages.create(model="smollm2", max_tokens=32, messages=QUESTION, **GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_errors_come_in_anthropics_envelope(client, url):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=QUESTION)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2", max_tokens=4, messages=QUESTION)
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                   json={"model": "smollm2", "messages": QUESTION})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required"}}
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, content=b"{",
                   timeout=30)
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"


# -- a tool round trip --------------------------------------------------------------------------
TOOLS = [{"name": "get_weather", "description": "The weather in a city now.",
          "input_schema": WEATHER},
         {"name": "add", "description": "The sum of two numbers.", "input_schema": ADD}]


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_a_tool_use_and_its_result_round_trip(qwen3_tools_url, streamed):
    client = anthropic.Anthropic(base_url=qwen3_tools_url, api_key="x", max_retries=0)
    ask = dict(model="qwen3-tools", max_tokens=64, **GREEDY, tools=TOOLS,
               tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "How warm is it in Oslo?"}])
    if streamed:
        with client.messages.stream(**ask) as stream:
            m = stream.get_final_message()
    else:
        m = client.messages.create(**ask)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    reply = client.messages.create(
        model="qwen3-tools", max_tokens=8, **GREEDY, tools=TOOLS,
        tool_choice={"type": "none"}, messages=[
            *ask["messages"], {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": json.dumps({"celsius": -3})}]}])
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in reply.content)
