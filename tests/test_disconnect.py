"""A client that goes away frees its lanes at once, streaming or not: real SmolLM2 in 2
stages behind real uvicorn, clients on raw sockets that hang up mid-request. Run inside a
loopback-only network namespace (see the Makefile)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.disconnect import ClientGone, unless_client_leaves
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.mesh.tokenizer import Tokenizer

@pytest.fixture(scope="module")
def long(smollm2) -> dict:
    """4000 tokens take minutes here, and no end-of-generation token may cut them short:
    the request is sure to be running when its client leaves."""
    return {"model": "smollm2", "prompt": "Write a very long story about a lighthouse.",
            "max_tokens": 4000, "temperature": 0.8,
            "logit_bias": {str(t): -100 for t in Tokenizer(smollm2).eog_ids}}


@pytest.fixture(scope="module")
def server(smollm2):
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2")
    assert engine.info.n_ctx > 4100
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        yield srv


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    wanted = ("skippy_engine_lanes_in_use", "skippy_gateway_requests_running")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.split(" ")[0] in wanted}


def lanes_in_use(url: str) -> float:
    return gauges(url)["skippy_engine_lanes_in_use"]


def send(url: str, path: str, body: dict) -> socket.socket:
    """A raw HTTP request whose answer nobody will read to the end."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    raw = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
                 .encode() + raw)
    return sock


def seconds_until_free(url: str, limit: float = 5.0) -> float:
    start = time.monotonic()
    while lanes_in_use(url) and time.monotonic() - start < limit:
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("chat", [False, True])
def test_a_client_that_leaves_a_long_request_frees_its_lane_within_a_second(server, long,
                                                                            chat):
    body = {**long, "messages": [{"role": "user", "content": long["prompt"]}]} if chat \
        else long
    sock = send(server.url, "/v1/chat/completions" if chat else "/v1/completions", body)
    time.sleep(1.0)
    assert lanes_in_use(server.url) == 1  # still generating, its lane held
    sock.close()
    assert seconds_until_free(server.url) < 1.0
    assert gauges(server.url)["skippy_gateway_requests_running"] == 0


def test_a_stream_whose_client_leaves_frees_its_lane_within_a_second(server, long):
    sock = send(server.url, "/v1/completions", {**long, "stream": True})
    sock.settimeout(30)
    assert b"200 OK" in sock.recv(4096)  # the stream has started
    time.sleep(1.0)
    assert lanes_in_use(server.url) == 1
    sock.close()
    assert seconds_until_free(server.url) < 1.0


def test_a_client_that_leaves_while_waiting_for_a_lane_gives_it_up(smollm2, long):
    """One lane: a second request waits for it; once its client leaves, it is out of
    the line and the first request's lane, once freed, is not taken by a ghost."""
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(enabled=False),
                             model_name="smollm2", lanes=1)
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        first = send(srv.url, "/v1/completions", long)
        time.sleep(0.5)
        second = send(srv.url, "/v1/completions", long)
        time.sleep(0.5)
        assert engine.admission.waiting == 1
        second.close()
        start = time.monotonic()
        while engine.admission.waiting and time.monotonic() - start < 2:
            time.sleep(0.02)
        assert engine.admission.waiting == 0 and lanes_in_use(srv.url) == 1
        first.close()
        assert seconds_until_free(srv.url) < 1.0


# -- the watcher alone ------------------------------------------------------------------------------
def test_work_that_ends_first_is_answered_and_its_watcher_stops():
    got = []

    async def receive():
        got.append("asked")
        await asyncio.sleep(10)

    async def run():
        return await unless_client_leaves(receive, asyncio.sleep(0.01, result="done"))

    assert asyncio.run(run()) == "done" and got == ["asked"]


def test_a_disconnect_cancels_the_work_and_waits_for_its_cleanup():
    cleaned = threading.Event()
    messages = [{"type": "http.request", "body": b"", "more_body": False},
                {"type": "http.disconnect"}]

    async def receive():
        await asyncio.sleep(0.01)
        return messages.pop(0)

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)  # cleanup that itself awaits
            cleaned.set()

    async def run():
        with pytest.raises(ClientGone):
            await unless_client_leaves(receive, work())
        return cleaned.is_set()

    assert asyncio.run(run())
