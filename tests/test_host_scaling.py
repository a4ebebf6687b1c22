"""Capacity that follows load, on hosts that really are separate (tests/hosts.py):
`skippy serve --stages 2 --lanes 3 --max-pipelines 2 --release-idle 5` on host 1. Rounds
of 12 greedy streams at once (each round in a cache namespace of its own) keep up to 9
requests waiting for the 3 lanes; after 2 s of that the gateway adds a pipeline where a whole copy
fits, and the time the streams wait for their first token falls. Every answer is the
fault-free one; once the load ends the added pipeline is released and the status page's
plan holds pipeline 0 alone.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request

import pytest

pytest.importorskip("ray")

from hosts import planned, serving  # noqa: E402
from test_host_loss import fault_free  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8005
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Why is the sky blue?", "Write a haiku about rivers.",
             "What is two plus two?", "Name a large ocean."]
STREAMS = QUESTIONS * 2  # 12 at once on 3 lanes: waits of several seconds
MAX_TOKENS = 24


def _pipelines(base: str) -> set[int]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=60) as r:
        return {row["pipeline"] for row in json.loads(r.read())["plan"]["stages"]}


def _round(base: str, salt: str) -> tuple[list[str], list[float]]:
    """The streams at once: their texts, and each one's wait for its first token."""
    import openai
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    texts, waits, errors = [""] * len(STREAMS), [0.0] * len(STREAMS), []

    def stream(i: int) -> None:
        t = time.monotonic()
        try:
            for chunk in client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": STREAMS[i]}],
                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"cache_salt": f"{salt}-{i // len(QUESTIONS)}"}):
                if chunk.choices and chunk.choices[0].delta.content:
                    if not texts[i]:
                        waits[i] = time.monotonic() - t
                    texts[i] += chunk.choices[0].delta.content
        except BaseException as e:  # noqa: BLE001 - told by the main thread
            errors.append(e)
    runs = [threading.Thread(target=stream, args=(i,)) for i in range(len(STREAMS))]
    for r in runs:
        r.start()
    for r in runs:
        r.join(300)
    assert not errors, errors
    return texts, waits


def test_waiting_requests_add_a_pipeline_and_the_wait_falls_then_it_goes(hosts, smollm2):
    head = hosts[0]
    with serving(head, PORT, "--model", str(smollm2), "--stages", "2", "--ctx", "1024",
                 "--lanes", "3", "--weight-format", "int4", "--max-pipelines", "2",
                 "--release-idle", "5", log="scaling.log") as log:
        want = fault_free(smollm2, [(a, b) for a, b, _ in planned(log.read_text())],
                          QUESTIONS) * 2
        base = f"http://{head.ip}:{PORT}"
        rounds, deadline = [], time.monotonic() + 240
        while True:  # rounds until one ran wholly with the second pipeline serving
            grown = _pipelines(base) == {0, 1}
            texts, waits = _round(base, f"round-{len(rounds)}")
            assert texts == want, (len(rounds), log.read_text()[-3000:])
            rounds.append(waits)
            if grown:
                break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
        text = log.read_text()
        assert "requests wait for lanes: pipeline 1 added" in text, text[-3000:]
        before, after = statistics.mean(rounds[0]), statistics.mean(rounds[-1])
        assert after < 0.8 * before, rounds
        deadline = time.monotonic() + 60
        # the load ended: released after 5 s idle (the status drops it while its actors
        # go; the log says so once they went)
        while _pipelines(base) != {0} or "pipeline 1 idle" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert _round(base, "after")[0] == want  # serving on
        print(f"\n12 streams on 3 lanes: mean wait for the first token {before:.2f} s with "
              f"one pipeline, {after:.2f} s with two ({len(rounds)} rounds); pipeline 1 "
              f"released once idle")
