"""POST /tokenize and /detokenize (mesh/front/tokenize_api.py) in llama-server's and
vLLM's shapes, over HTTP (real uvicorn on loopback: run inside a loopback-only network
namespace), against the model's own tokenizer and the chat endpoint's prompt."""

from __future__ import annotations

import httpx
import pytest

from skippy.mesh.tokenizer import Tokenizer

KEY = "sesame"
TEXT = "The harbour town woke slowly. <|im_end|> Ünïcode ✓"


@pytest.fixture(scope="module")
def http(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(smollm2, 1, cache=CacheConfig(enabled=False), n_ctx=512,
                             model_name="smollm2", weight_format="int4")
    with BackgroundServer(create_app(engine, api_keys=[KEY])) as srv, \
            httpx.Client(base_url=srv.url, timeout=60,
                         headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def tok(smollm2):
    return Tokenizer(smollm2)


def test_llama_server_shape(http, tok):
    r = http.post("/tokenize", json={"content": TEXT})
    assert r.status_code == 200
    ids = tok.encode(TEXT, add_special=False)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    assert tok.special_id("<|im_end|>") in ids  # a control spelling is that token here
    pieces = http.post("/tokenize", json={"content": "✓", "with_pieces": True}).json()
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else
                    p["piece"].encode() for p in pieces["tokens"]) == "✓".encode()
    back = http.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"content": TEXT, "prompt": TEXT}


def test_vllm_shapes_and_the_chat_prompt(http, tok):
    got = http.post("/tokenize", json={"model": "smollm2", "prompt": "Hi"}).json()
    assert got["tokens"] == tok.encode("Hi", add_special=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    counted = http.post("/tokenize", json={"model": "smollm2", "messages": messages}).json()
    chat = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                   "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"content": 3}, 400, "content"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, 400, "add_special"),
    ("/tokenize", {"model": "other", "content": "x"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "nobody"}]}, 400, "messages"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
])
def test_bad_bodies_are_4xx_in_the_envelope(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_keys_guard_them(http):
    r = httpx.post(str(http.base_url.join("/tokenize")), json={"content": "x"})
    assert r.status_code == 401
