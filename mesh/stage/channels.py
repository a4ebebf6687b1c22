"""The options of every gRPC channel and server between stages and their callers.

Messages are capped at the largest one the two ends exchange (the caller passes it), and
keepalive pings run even on idle channels, so a peer that vanished (a node lost) ends its
streams instead of leaving them hanging. The stage service, the block and part fetchers
and the driver's links all take their options here.

A session stream whose request ended with its `last` call answered (every stage behind it
has closed its session by then) is kept open for the next request (`IdleLinks`): opening a
stream costs about twice a message on an open one (~1.1-1.5 ms against 0.5 ms a request
on this project's 2-core test machine), once per hop.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

# A test hook standing in for a network's latency (this kernel has no netem): with it set,
# every message between the driver and the stages, and between stages, waits this many
# milliseconds at its sender. Stage actors inherit it from the gateway's environment.
HOP_DELAY_ENV = "SKIPPY_TEST_HOP_DELAY_MS"


# A second hook shapes links of different lengths: "IP=MS,IP=MS" gives hosts a delay each
# (their link to a switch), and a message between two hosts waits both hosts' delays at
# its sender (none within a host). The link probe adds the same to what it times, so the
# planner sees these links (mesh/control/link_probe.py).
HOST_DELAY_ENV = "SKIPPY_TEST_HOST_DELAY_MS"


def hop_delay_s() -> float:
    """The test hook's one-way delay per message, in seconds (0 where unset)."""
    try:
        return max(0.0, float(os.environ.get(HOP_DELAY_ENV) or 0)) / 1e3
    except ValueError:
        return 0.0


def host_delay_s(here: str, there: str) -> float:
    """The host hook's one-way delay from host `here` to host `there` (IPs, addresses or
    gRPC peers such as "ipv4:10.0.0.2:5000"), in seconds; 0 where unset."""
    delays: dict[str, float] = {}
    for item in (os.environ.get(HOST_DELAY_ENV) or "").split(","):
        ip, _, ms = item.partition("=")
        try:
            delays[ip.strip()] = max(0.0, float(ms)) / 1e3
        except ValueError:
            continue
    a, b = _ip(here), _ip(there)
    return 0.0 if not delays or a == b else delays.get(a, 0.0) + delays.get(b, 0.0)


def link_delay_s(here: str, there: str) -> float:
    """Both hooks' delay for a message from `here` to `there`."""
    return hop_delay_s() + host_delay_s(here, there)


def _ip(address: str) -> str:
    """The host part of an IP, a host:port address or a gRPC peer."""
    address = address.removeprefix("ipv4:").removeprefix("ipv6:")
    if address.startswith("["):
        return address[1:address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


# A closing session stream waits this long for the stage behind it to end its session
# (its lane kept warm), so that a request's end reaches its client only once every stage
# holds the lane for a follow-up; a stage that does not end by then is cut off.
CLOSE_S = 5.0


def channel_options(max_message: int) -> list[tuple[str, int]]:
    """gRPC options for a channel or server whose messages are at most `max_message`
    bytes, with keepalive pings every 20 s (a silent peer is dropped 10 s later)."""
    return [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# Idle session streams kept per opener, and how long one may wait for its next request
# (well inside the stage's IDLE_S, after which it would cancel the stream).
IDLE_LINKS = 4
IDLE_LINK_S = 30.0


class IdleLinks:
    """Links whose request ended cleanly, newest last, for the next request to take. The
    caller closes what `take`, `put` and `drain` hand back (stale or surplus links).
    Thread-safe."""

    def __init__(self, keep: int = IDLE_LINKS, idle_s: float = IDLE_LINK_S,
                 clock=time.monotonic):
        self.keep, self.idle_s, self.clock = keep, idle_s, clock
        self._links: list[tuple[float, Any]] = []
        self._lock = threading.Lock()
        self.reused = 0  # links taken again: streams not opened

    def take(self) -> tuple[Any | None, list]:
        """(the newest link idle for less than idle_s or None, the stale ones to close)."""
        with self._lock:
            fresh = self.clock() - self.idle_s
            stale = [link for t, link in self._links if t < fresh]
            self._links = [(t, link) for t, link in self._links if t >= fresh]
            link = self._links.pop()[1] if self._links else None
            self.reused += link is not None
            return link, stale

    def put(self, link) -> list:
        """Keep `link`; the links to close: the oldest beyond `keep`."""
        with self._lock:
            self._links.append((self.clock(), link))
            surplus = self._links[:-self.keep] if len(self._links) > self.keep else []
            del self._links[:len(surplus)]
            return [link for _, link in surplus]

    def drain(self) -> list:
        """Every link held, to close (the peer changed or the owner is closing)."""
        with self._lock:
            links, self._links = [link for _, link in self._links], []
            return links


class SilentPeer(ConnectionError):
    """A peer sent nothing on a stream for longer than its silence deadline."""


def within_silence(call: Any, silence_s: float) -> Iterator[Any]:
    """The messages of a server-streaming call, the call cancelled when `silence_s` pass
    without one (raising SilentPeer). gRPC's own deadline covers the whole stream, so a
    large transfer at a slow, steady rate would miss it; a peer that stops sending is what
    should be given up on."""
    last, done, silent = [time.monotonic()], threading.Event(), threading.Event()

    def watch() -> None:
        while not done.wait(max(0.0, last[0] + silence_s - time.monotonic())):
            if time.monotonic() - last[0] >= silence_s:
                silent.set()
                call.cancel()
                return

    threading.Thread(target=watch, daemon=True, name="stream-silence").start()
    try:
        for message in call:
            last[0] = time.monotonic()
            yield message
    except Exception:
        if silent.is_set():
            raise SilentPeer(f"silent for {silence_s:g} s") from None
        raise
    finally:
        done.set()
