"""The options of every gRPC channel and server between stages and their callers.

Messages are capped at the largest one the two ends exchange (the caller passes it), and
keepalive pings run even on idle channels, so a peer that vanished (a node lost) ends its
streams instead of leaving them hanging. The stage service, the block and part fetchers
and the driver's links all take their options here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

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
