"""A 6-turn chat through 2 stages over HTTP: each turn after the first computes only the
rows past what the stages already hold (its earlier turns and the replies to them, to
the token), as `/metrics`' `skippy_stage_prefill_rows_total` counts them, and answers
exactly what the same pipeline with its caches off answers.

Run inside a loopback-only network namespace (see the Makefile)."""

from __future__ import annotations

import re

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.chat import encode_chat, load_chat_template
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.mesh.tokenizer import Tokenizer

USER = ["Name three rivers in Europe.", "Which of them is the longest?",
        "How long is it, roughly?", "Which countries does it flow through?",
        "Pick one of those countries and name its capital.", "Thanks. Summarise in a line."]
REPLY_TOKENS = 8


def engine(path, cache: CacheConfig) -> InProcessEngine:
    return InProcessEngine(path, 2, cache=cache, model_name="smollm2", weight_format="int4")


def rows_computed(client: httpx.Client) -> list[int]:
    text = client.get("/metrics").text
    return [int(float(re.search(rf'skippy_stage_prefill_rows_total{{stage="{i}"}} (\S+)',
                                text).group(1))) for i in (0, 1)]


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow
def test_six_turns_compute_only_their_new_rows_and_answer_as_uncached(smollm2):
    tok = Tokenizer(smollm2)
    template = load_chat_template(tok)
    off = engine(smollm2, CacheConfig(enabled=False))
    messages, held = [], []
    reply_reused = []
    with BackgroundServer(create_app(engine(smollm2, CacheConfig()), api_keys=())) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as client:
        for turn, text in enumerate(USER):
            messages.append({"role": "user", "content": text})
            ids = encode_chat(template, tok, messages)
            want = [s.token for s in off.complete(ids, REPLY_TOKENS, probe=True,
                                                  stop_ids=frozenset(tok.eog_ids))]
            before = rows_computed(client)
            r = client.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": messages, "temperature": 0,
                "max_tokens": REPLY_TOKENS})
            assert r.status_code == 200, r.text
            body = r.json()
            reply = body["choices"][0]["message"]["content"]
            assert reply == tok.decode([t for t in want if t not in tok.eog_ids])
            usage = body["usage"]
            assert usage["prompt_tokens"] == len(ids)
            reuse = shared(held, ids)  # what the stages hold that this prompt repeats
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            computed = [b - a for a, b in zip(before, rows_computed(client))]
            if turn:
                assert cached == reuse, (turn, cached, reuse)
                assert computed == [len(ids) - reuse] * 2, (turn, computed, len(ids), reuse)
                last_reply = held[len(prev_ids):]
                reply_reused.append(max(0, reuse - len(prev_ids)) / len(last_reply))
            # the stages now hold the prompt and every reply token fed back (not the last)
            prev_ids, held = ids, ids + want[:-1]
            messages.append({"role": "assistant", "content": reply})
    print(f"reply tokens reused by the next turn: "
          f"{', '.join(f'{f:.0%}' for f in reply_reused)}")
    assert min(reply_reused) > 0.5
