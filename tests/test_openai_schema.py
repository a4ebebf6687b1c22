"""Every response body matches OpenAI's published schema: chat (whole and every streamed
chunk, with and without tool calls, log-probs, several choices, usage), completions,
the model list, and error bodies, validated against the JSON schemas of OpenAI's OpenAPI
document (tests/data/openai: the few schemas needed, with their source and version).

Real uvicorn on loopback over a random-weight qwen3 with a tool-aware chat template
(conftest: qwen3_tools) in 2 stages. Run inside a loopback-only network namespace."""

from __future__ import annotations

import json

import httpx
import pytest
from openai_schemas import conforms, source, validator


MODEL = "qwen3-tools"
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
         {"type": "function", "function": {"name": "noop"}}]
CHAT = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
FORCED = {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 48}


@pytest.fixture(scope="module")
def client(qwen3_tools_url):
    with httpx.Client(base_url=qwen3_tools_url, timeout=120) as c:
        yield c


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    return [json.loads(e[6:]) for e in r.text.split("\n\n")[:-2] if e]


def test_the_schemas_are_the_published_ones_and_catch_what_the_issue_found():
    assert source()["repository"] == "openai/openai-openapi" and len(source()["commit"]) == 40
    chat = validator("CreateChatCompletionResponse")
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "hi"}}]}
    assert not chat.is_valid(body)  # a message without refusal: what fuzzing found
    body["choices"][0]["message"]["refusal"] = None
    assert chat.is_valid(body)
    chunk = validator("CreateChatCompletionStreamResponse")
    assert chunk.is_valid({"id": "x", "object": "chat.completion.chunk", "created": 1,
                           "model": "m", "choices": [{"index": 0, "delta": {},
                                                      "finish_reason": None}]})


@pytest.mark.parametrize("extra", [
    {}, {"n": 2, "temperature": 1.0, "seed": 3}, {"logprobs": True, "top_logprobs": 2},
    {"stop": ["."], "max_completion_tokens": 3}], ids=["plain", "n2", "logprobs", "stop"])
def test_chat_responses_conform(client, extra):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    conforms("CreateChatCompletionResponse", body)
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
        assert (choice["logprobs"] is None) == ("logprobs" not in extra)
    assert body["system_fingerprint"].startswith("fp_")


@pytest.mark.parametrize("extra", [
    {}, {"stream_options": {"include_usage": True}, "n": 2},
    {"logprobs": True, "top_logprobs": 1}], ids=["plain", "usage-n2", "logprobs"])
def test_chat_stream_chunks_conform(client, extra):
    chunks = events(client.post("/v1/chat/completions",
                                json={**CHAT, **extra, "stream": True}))
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    fingerprints = {c["system_fingerprint"] for c in chunks}
    assert len(fingerprints) == 1 and len({c["id"] for c in chunks}) == 1
    if "stream_options" in extra:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])


def test_tool_call_responses_conform(client):
    r = client.post("/v1/chat/completions", json=FORCED)
    body = r.json()
    conforms("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["tool_calls"][0]["type"] == "function"
    chunks = events(client.post("/v1/chat/completions", json={**FORCED, "stream": True}))
    calls = [c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) > 2
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)


def test_completions_conform(client):
    for extra in ({}, {"logprobs": 2, "n": 2, "temperature": 1.0, "seed": 1},
                  {"prompt": ["a", "b"]}):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                 "max_tokens": 3, **extra})
        conforms("CreateCompletionResponse", r.json())


def test_the_model_list_conforms(client):
    conforms("ListModelsResponse", client.get("/v1/models").json())
    conforms("Model", client.get(f"/v1/models/{MODEL}").json())


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "model": "gpt-5"}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
    ("/v1/chat/completions", {**FORCED, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
    ("/v1/nowhere", {}),
])
def test_error_bodies_conform(client, path, body):
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500
    conforms("ErrorResponse", r.json())
