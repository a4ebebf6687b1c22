"""Choosing a pipeline for a request: where its prefix is cached, else the least loaded.

The router remembers, per pipeline, the digests of the chunk-aligned prefixes it sent
there recently (a bounded LRU each). A new request goes to the pipeline that served the
longest prefix of it — its stages most likely still hold that state — unless that
pipeline is much busier than the idlest one; otherwise to the least loaded. The request
then stays on its pipeline for its whole life.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from skippy.cache.identity import prefix_digests

REMEMBERED = 4096        # prefix digests kept per pipeline
MAX_IMBALANCE = 4        # in-flight requests a cached prefix may cost over the idlest


class Router:
    def __init__(self, n_pipelines: int, stride: int):
        if n_pipelines < 1:
            raise ValueError("a router needs at least one pipeline")
        self.stride = stride
        self.load = [0] * n_pipelines
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(n_pipelines)]
        self._lock = threading.Lock()

    def _digests(self, tokens: Sequence[int], namespace: str) -> dict[int, bytes]:
        lengths = range(self.stride, len(tokens) + 1, self.stride)
        return prefix_digests(namespace.encode(), tokens, list(lengths))

    def choose(self, tokens: Sequence[int], namespace: str = "") -> int:
        """The pipeline for this request; counted as in flight until `finished`."""
        digests = self._digests(tokens, namespace)
        longest_first = sorted(digests, reverse=True)
        with self._lock:
            idlest = min(range(len(self.load)), key=lambda p: (self.load[p], p))
            best, best_len = idlest, 0
            for p, seen in enumerate(self._seen):
                if self.load[p] - self.load[idlest] > MAX_IMBALANCE:
                    continue
                length = next((n for n in longest_first if digests[n] in seen), 0)
                if length > best_len or (length == best_len and length
                                         and self.load[p] < self.load[best]):
                    best, best_len = p, length
            self.load[best] += 1
            seen = self._seen[best]
            for d in digests.values():
                seen[d] = None
                seen.move_to_end(d)
            while len(seen) > REMEMBERED:
                seen.popitem(last=False)
            return best

    def finished(self, pipeline: int) -> None:
        with self._lock:
            self.load[pipeline] -= 1
