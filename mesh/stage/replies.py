"""The drivers' reply streams at a last stage (Stage.Replies): a decode call sent with
`reply_to` is answered there, straight to the driver, instead of climbing back through
every stage (DESIGN.md §4). Thread-safe."""

from __future__ import annotations

import queue
import threading

from skippy.proto import stage_pb2 as pb


class ReplyStreams:
    def __init__(self):
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self.sent = 0  # answers sent this way

    def open(self, stream_id: str) -> queue.Queue:
        """A new stream's queue (one that reused an id replaces the old one)."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[stream_id] = q
        return q

    def close(self, stream_id: str, q: queue.Queue) -> None:
        with self._lock:
            if self._queues.get(stream_id) is q:
                del self._queues[stream_id]

    def fail(self, stream_id: str, message: str) -> None:
        """Tell the driver the request's stages broke (it rebuilds the request)."""
        self.send(stream_id, pb.StageResult(error=pb.Error(message=message, retryable=True)))

    def send(self, stream_id: str, result: pb.StageResult) -> bool:
        """Answer on the driver's stream; False when it is gone (the driver ended it)."""
        with self._lock:
            q = self._queues.get(stream_id)
            if q is None:
                return False
            self.sent += 1
        q.put(result)
        return True
