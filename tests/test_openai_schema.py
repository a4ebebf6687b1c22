"""Every response body matches OpenAI's published schema: chat (whole and every streamed
chunk, with and without tool calls, log-probs, several choices, usage), completions,
the model list, and error bodies, validated against the JSON schemas of OpenAI's OpenAPI
document (tests/data/openai: the few schemas needed, with their source and version).

Real uvicorn on loopback over a random-weight qwen3 with a tool-aware chat template
(conftest: qwen3_tools) in 2 stages. Run inside a loopback-only network namespace."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app

MODEL = "qwen3-tools"
DOCUMENT = Path(__file__).parent / "data" / "openai" / "response_schemas.json"
BASE = "https://schemas.test/openai.json"
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
         {"type": "function", "function": {"name": "noop"}}]
CHAT = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
FORCED = {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 48}


def or_null(node):
    """OpenAPI 3.0's `nullable: true` (some of OpenAI's schemas still say it) as JSON
    Schema spells it: the schema, or null."""
    if isinstance(node, list):
        return [or_null(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: or_null(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


@pytest.fixture(scope="module")
def schema():
    document = or_null(json.loads(DOCUMENT.read_text()))
    registry = Registry().with_resource(BASE, Resource(document, DRAFT202012))

    def validator(name: str):
        return jsonschema.Draft202012Validator(
            {"$ref": f"{BASE}#/components/schemas/{name}"}, registry=registry)
    return validator


def conforms(validator, body) -> None:
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


@pytest.fixture(scope="module")
def client(qwen3_tools):
    engine = InProcessEngine(qwen3_tools, 2, cache=CacheConfig(enabled=False),
                             model_name=MODEL)
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    return [json.loads(e[6:]) for e in r.text.split("\n\n")[:-2] if e]


def test_the_schemas_are_the_published_ones_and_catch_what_the_issue_found(schema):
    source = json.loads(DOCUMENT.read_text())["x-source"]
    assert source["repository"] == "openai/openai-openapi" and len(source["commit"]) == 40
    chat = schema("CreateChatCompletionResponse")
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "hi"}}]}
    assert not chat.is_valid(body)  # a message without refusal: what fuzzing found
    body["choices"][0]["message"]["refusal"] = None
    assert chat.is_valid(body)
    chunk = schema("CreateChatCompletionStreamResponse")
    assert chunk.is_valid({"id": "x", "object": "chat.completion.chunk", "created": 1,
                           "model": "m", "choices": [{"index": 0, "delta": {},
                                                      "finish_reason": None}]})


@pytest.mark.parametrize("extra", [
    {}, {"n": 2, "temperature": 1.0, "seed": 3}, {"logprobs": True, "top_logprobs": 2},
    {"stop": ["."], "max_completion_tokens": 3}], ids=["plain", "n2", "logprobs", "stop"])
def test_chat_responses_conform(client, schema, extra):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    conforms(schema("CreateChatCompletionResponse"), body)
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
        assert (choice["logprobs"] is None) == ("logprobs" not in extra)
    assert body["system_fingerprint"].startswith("fp_")


@pytest.mark.parametrize("extra", [
    {}, {"stream_options": {"include_usage": True}, "n": 2},
    {"logprobs": True, "top_logprobs": 1}], ids=["plain", "usage-n2", "logprobs"])
def test_chat_stream_chunks_conform(client, schema, extra):
    chunks = events(client.post("/v1/chat/completions",
                                json={**CHAT, **extra, "stream": True}))
    for chunk in chunks:
        conforms(schema("CreateChatCompletionStreamResponse"), chunk)
    fingerprints = {c["system_fingerprint"] for c in chunks}
    assert len(fingerprints) == 1 and len({c["id"] for c in chunks}) == 1
    if "stream_options" in extra:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])


def test_tool_call_responses_conform(client, schema):
    r = client.post("/v1/chat/completions", json=FORCED)
    body = r.json()
    conforms(schema("CreateChatCompletionResponse"), body)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["tool_calls"][0]["type"] == "function"
    chunks = events(client.post("/v1/chat/completions", json={**FORCED, "stream": True}))
    calls = [c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) > 2
    for chunk in chunks:
        conforms(schema("CreateChatCompletionStreamResponse"), chunk)


def test_completions_conform(client, schema):
    for extra in ({}, {"logprobs": 2, "n": 2, "temperature": 1.0, "seed": 1},
                  {"prompt": ["a", "b"]}):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                 "max_tokens": 3, **extra})
        conforms(schema("CreateCompletionResponse"), r.json())


def test_the_model_list_conforms(client, schema):
    conforms(schema("ListModelsResponse"), client.get("/v1/models").json())
    conforms(schema("Model"), client.get(f"/v1/models/{MODEL}").json())


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "model": "gpt-5"}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
    ("/v1/chat/completions", {**FORCED, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
    ("/v1/nowhere", {}),
])
def test_error_bodies_conform(client, schema, path, body):
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500
    conforms(schema("ErrorResponse"), r.json())
