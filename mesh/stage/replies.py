"""The drivers' reply streams at a last stage (Stage.Replies): a decode call sent with
`reply_to` is answered there, straight to the driver, instead of climbing back through
every stage (DESIGN.md §4). A stream is a sink the answer is handed to: a queue's `put`
for a gRPC stream's thread to send, or a socket's own send for a driver on this node
(mesh/stage/local_link.py), called from the loop thread as the step ends. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Callable

from skippy.proto import stage_pb2 as pb


class ReplyStreams:
    def __init__(self):
        self._sinks: dict[str, Callable[[pb.StageResult], None]] = {}
        self._lock = threading.Lock()
        self.sent = 0  # answers sent this way

    def open(self, stream_id: str, sink: Callable[[pb.StageResult], None]) -> None:
        """A new stream (one that reused an id replaces the old one)."""
        with self._lock:
            self._sinks[stream_id] = sink

    def close(self, stream_id: str, sink: Callable[[pb.StageResult], None]) -> None:
        with self._lock:
            if self._sinks.get(stream_id) == sink:  # a bound method is made anew each time
                del self._sinks[stream_id]

    def fail(self, stream_id: str, message: str) -> None:
        """Tell the driver the request's stages broke (it rebuilds the request)."""
        self.send(stream_id, pb.StageResult(error=pb.Error(message=message, retryable=True)))

    def send(self, stream_id: str, result: pb.StageResult) -> bool:
        """Answer on the driver's stream; False when it is gone (the driver ended it)."""
        with self._lock:
            sink = self._sinks.get(stream_id)
            if sink is None:
                return False
            self.sent += 1
        try:
            sink(result)
        except OSError:  # a socket whose driver went
            return False
        return True
