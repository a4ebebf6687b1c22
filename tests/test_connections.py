"""What a connection may hold before it is a request (mesh/front/connections.py): a
deadline for its headers and body, a cap on connections, and a server that keeps serving
through slow sockets and oversized requests. Real uvicorn on loopback, real sockets; the
attack runs SmolLM2 in 2 stages. Run inside a loopback-only network namespace (see the
Makefile)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.connections import raise_file_limit
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.mesh.front.limits import GatewayLimits
from skippy.topology.errors import UserError

KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def engine(smollm2):
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(enabled=False), model_name="smollm2")
    yield engine
    asyncio.run(engine.close())


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def test_the_limits_are_checked():
    for bad in ({"read_timeout_s": 0}, {"read_timeout_s": float("inf")},
                {"max_connections": 0}):
        with pytest.raises(UserError):
            GatewayLimits(**bad)


def test_headers_too_slow_get_a_408_and_a_slow_body_is_dropped(engine):
    limits = GatewayLimits(read_timeout_s=1.0)
    with BackgroundServer(create_app(engine, limits=limits)) as srv:
        # headers, a byte every 0.2 s: never finished within the second
        slow = connect(srv.url)
        start = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n":
            try:
                slow.send(bytes([byte]))
            except OSError:
                break  # closed by the server
            time.sleep(0.2)
        answer = read_all(slow)
        took = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert 0.9 < took < 3, took
        # a body that stops coming: the route sees the client leave, the server goes on
        stalled = connect(srv.url)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        start = time.monotonic()
        read_all(stalled)
        assert time.monotonic() - start < 3
        # a request that comes in time, on a connection kept alive past the first deadline
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            time.sleep(0.6)
            assert c.get("/health").status_code == 200
            time.sleep(0.6)  # past the first request's deadline: each has its own
            assert c.get("/v1/models").status_code == 200


def test_a_connection_beyond_the_cap_gets_a_503_at_once(engine):
    limits = GatewayLimits(max_connections=3)
    with BackgroundServer(create_app(engine, limits=limits)) as srv:
        held = [connect(srv.url) for _ in range(3)]
        time.sleep(0.2)
        extra = connect(srv.url)
        answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer, answer
        held.pop().close()
        time.sleep(0.2)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        for s in held:
            s.close()


def test_the_descriptor_limit_rises_to_hold_the_connections():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert raise_file_limit(1000) == min(1000, hard)
        assert raise_file_limit(500) == min(1000, hard)  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_key_over_its_body_budget_gets_a_429_before_its_body_is_read(engine):
    limits = GatewayLimits(max_body_bytes=2**20, body_bytes_per_s=1024)  # bursts of 2 MiB
    with BackgroundServer(create_app(engine, api_keys=["a", "b"], limits=limits)) as srv:
        # just under 1 MiB, refused as soon as it is parsed (max_tokens): a 400
        big = b'{"model": "smollm2", "max_tokens": -1, "prompt": "' + b"x" * (2**20 - 80) + b'"}'
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            def post(key):
                return c.post("/v1/completions", content=big, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            assert post("a").status_code == post("a").status_code == 400  # the burst
            refused = post("a")
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(refused.headers["Retry-After"]) > 1000  # a MiB at a KiB a second
            assert post("b").status_code == 400  # another key is not held back
