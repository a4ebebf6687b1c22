"""A 3-stage pipeline across three separate hosts (tests/hosts.py) with 10 ms on every hop:
the transport's latency test hook (`SKIPPY_TEST_HOP_DELAY_MS`; this kernel has no netem)
delays each message between the gateway and the stages, and between stages, at its
sender. A decode step's token comes from the last host straight to the gateway (4 hops a
token, not 6), and speculation gives the same text in fewer steps. Prints ms per token
with speculation off and on (evals/README.md quotes the figures).

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("ray")

import httpx  # noqa: E402

from hosts import serving  # noqa: E402
from skippy.mesh.stage.channels import HOP_DELAY_ENV  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8010
HOP_MS = 10
TOKENS = 48
# a code edit: the reply repeats the code, which prompt lookup proposes
CODE_EDIT = ("Rename the variable `total` to `sum_of_items` in this function and give back the "
             "whole function:\n\ndef add_all(items):\n    total = 0\n    for item in items:\n"
             "        total = total + item\n    return total\n")


def _stream(base: str) -> tuple[str, float]:
    """A greedy chat stream of TOKENS tokens: its text and ms per token after the first."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": CODE_EDIT}],
            "max_tokens": TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, first, tokens = "", None, 0
    with httpx.Client(timeout=300) as client, \
            client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    text += choice["delta"]["content"]
                    first = first or time.perf_counter()
    assert tokens > 1 and first is not None
    return text, (time.perf_counter() - first) * 1e3 / (tokens - 1)


def _metric(base: str, name: str) -> float:
    """The sum of `name`'s samples in the gateway's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_token_crosses_each_hop_once_and_speculation_keeps_the_text(hosts, smollm2,
                                                                      monkeypatch):
    monkeypatch.setenv(HOP_DELAY_ENV, str(HOP_MS))  # the gateway passes it to its stages
    runs = {}
    for i, speculate in enumerate(("off", "on")):
        with serving(hosts[0], PORT + i, "--model", str(smollm2), "--stages", "3",
                     "--ctx", "1024", "--lanes", "1", "--weight-format", "int4",
                     "--speculate", speculate, log=f"serve-hops-{speculate}.log"):
            base = f"http://{hosts[0].ip}:{PORT + i}"
            text, ms = _stream(base)
            runs[speculate] = (text, ms,
                               _metric(base, "skippy_stage_direct_replies_total"),
                               _metric(base, "skippy_speculation_accepted_tokens_total"))
    (off, off_ms, direct, _), (on, on_ms, _, accepted) = runs["off"], runs["on"]
    print(f"\n3 stages on 3 hosts, {HOP_MS} ms a hop, {TOKENS} tokens: "
          f"{off_ms:.1f} ms/token without speculation, {on_ms:.1f} with "
          f"({off_ms / on_ms:.2f}x, {accepted:.0f} proposed tokens accepted)")
    assert off and on == off
    # each decode step waited on its 4 hops: the gateway to each of the 3 stages in turn,
    # the last stage's answer straight back (the hook is in every link)...
    assert off_ms >= 4 * HOP_MS
    # ...and the steps before the last were answered by the last stage directly
    assert direct >= TOKENS // 2
    assert accepted > 0
