"""The official openai client against the gateway: what users will actually run.

Real uvicorn on loopback, real SmolLM2 in 2 stages; the client never leaves 127.0.0.1
(base_url set, no retries). Run inside a loopback-only network namespace."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.front.chat import render_chat
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.mesh.tokenizer import Tokenizer
from tool_schemas import ADD, WEATHER

MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def tok(smollm2):
    return Tokenizer(smollm2)


@pytest.fixture(scope="module")
def pipe(smollm2):
    return InProcessEngine(smollm2, 2, cache=CacheConfig(enabled=False), model_name="smollm2",
                           weight_format="int4")


@pytest.fixture(scope="module")
def url(smollm2, pipe):
    engine = pipe
    with BackgroundServer(create_app(engine, api_keys=())) as plain, \
            BackgroundServer(create_app(engine, api_keys=["sesame"])) as keyed:
        yield plain.url, keyed.url


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url[0] + "/v1", api_key="x", max_retries=0) as c:
        yield c


def greedy_text(pipe, tok, text, n):
    ids = tok.encode(text)
    return tok.decode([s.token for s in pipe.complete(ids, n, stop_ids=frozenset(tok.eog_ids))])


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["smollm2"]


def test_completion_equals_the_pipelines_greedy_output(client, pipe, tok):
    prompt = "The three primary colors are"
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=5,
                                    temperature=0)
    assert out.choices[0].text == greedy_text(pipe, tok, prompt, 5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_with_usage(client, pipe, tok):
    prompt = "def add(a, b):"
    chunks = list(client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text(pipe, tok, prompt, 4)
    assert chunks[-1].usage.completion_tokens == 4


def test_logprobs_parse_into_the_clients_types(client, pipe, tok, smollm2):
    out = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
               for c in content)  # greedy: the chosen token is the most likely
    legacy = client.completions.create(model="smollm2", prompt="def add(a, b):",
                                       max_tokens=3, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 3


def test_chat_completion_equals_the_pipeline_on_the_rendered_template(client, pipe, tok,
                                                                       smollm2):
    expected = greedy_text(pipe, tok, render_chat(smollm2, MESSAGES), 4)
    out = client.chat.completions.create(model="smollm2", messages=MESSAGES,
                                         max_completion_tokens=4, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    # a repeat is answered from the tokens the gateway already knows
    again = client.chat.completions.create(model="smollm2", messages=MESSAGES,
                                           max_tokens=4, temperature=0)
    assert again.choices[0].message.content == expected
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens


def test_streamed_chat(client):
    full = client.chat.completions.create(model="smollm2", messages=MESSAGES,
                                          max_tokens=4, temperature=0,
                                          extra_body={"cache_salt": "other"})
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES,
                                            max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"n": 0}, {"logprobs": 21},
                                    {"temperature": -1}, {"top_p": 2},
                                    {"max_tokens": 10**6}])
def test_bad_requests_surface_as_bad_request_error(client, kwargs):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": "smollm2", "prompt": "hi", "max_tokens": 1,
                                     **kwargs})
    assert e.value.param == next(iter(kwargs))


def test_wrong_api_key_is_an_authentication_error(url):
    with openai.OpenAI(base_url=url[1] + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=url[1] + "/v1", api_key="sesame", max_retries=0) as c:
        assert [m.id for m in c.models.list()] == ["smollm2"]


# SmolLM2's template never reads `tools`: they are described to it (generic_tools)
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                            "description": "The weather in a city now.",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add",
                                            "description": "The sum of two numbers.",
                                            "parameters": ADD}}]


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "add"}}])
def test_a_template_without_tools_still_makes_a_forced_call(client, choice):
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "How warm is it in Oslo?"}],
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=0,
        max_tokens=64)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    name = call.function.name
    assert name == "add" if isinstance(choice, dict) else name in ("get_weather", "add")
    jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER,
                                                              "add": ADD}[name])
    # the call and its result go back to a template that has no tool messages
    answer = client.chat.completions.create(model="smollm2", tools=TOOLS, max_tokens=8,
                                            temperature=0, messages=[
        {"role": "user", "content": "How warm is it in Oslo?"},
        out.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees"}])
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens


@pytest.mark.parametrize("seed", range(6))
def test_auto_never_calls_a_function_not_offered(client, seed):
    """Sampled replies under "auto": text, or calls to the functions offered with
    arguments their schemas accept: the grammar starts when the reply opens a call."""
    out = client.chat.completions.create(
        model="smollm2", tools=TOOLS, temperature=1.5, seed=seed, max_tokens=48, messages=[
            {"role": "user", "content": "Use a tool: call get_weather or add, or delete_all."}])
    for call in out.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), {"get_weather": WEATHER,
                                                                  "add": ADD}[call.function.name])
    if out.choices[0].finish_reason != "length":  # a whole reply: no half-read call
        assert "<tool_call>" not in (out.choices[0].message.content or "")
