"""Choosing a pipeline for a request: where its prefix is cached, else the least loaded.

The router remembers, per pipeline, the digests of the chunk-aligned prefixes it sent
there recently (a bounded LRU each): the cluster's directory of which pipeline's stages
hold which prefix. A new request goes to the pipeline that served the longest prefix of
it — its stages most likely still hold that state — unless that pipeline is much busier
than the idlest one (or cannot serve now); otherwise to the least loaded. A request moved
away from its prefix learns where that prefix is (`Route.holder`): its stages then pull
the state from their counterparts there (mesh/stage/state_pull.py) instead of
recomputing it. The request stays on its pipeline for its whole life.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from skippy.cache.identity import prefix_digests

REMEMBERED = 4096        # prefix digests kept per pipeline
MAX_IMBALANCE = 4        # in-flight requests a cached prefix may cost over the idlest


@dataclass(frozen=True)
class Route:
    pipeline: int
    holder: int | None = None  # another pipeline that served a longer prefix of it


class Router:
    def __init__(self, n_pipelines: int, stride: int, max_imbalance: int = MAX_IMBALANCE):
        if n_pipelines < 1:
            raise ValueError("a router needs at least one pipeline")
        self.stride, self.max_imbalance = stride, max_imbalance
        self.load = [0] * n_pipelines
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(n_pipelines)]
        self.retired: set[int] = set()  # pipelines that take no new request
        self._lock = threading.Lock()

    def add(self) -> int:
        """A pipeline more (the engine grew): its index."""
        with self._lock:
            self.load.append(0)
            self._seen.append(OrderedDict())
            return len(self.load) - 1

    def retire(self, pipeline: int) -> None:
        """No new request goes to `pipeline` (its requests in flight end there)."""
        with self._lock:
            self.retired.add(pipeline)
            self._seen[pipeline].clear()

    def _digests(self, tokens: Sequence[int], namespace: str) -> dict[int, bytes]:
        lengths = range(self.stride, len(tokens) + 1, self.stride)
        return prefix_digests(namespace.encode(), tokens, list(lengths))

    def choose(self, tokens: Sequence[int], namespace: str = "") -> int:
        return self.route(tokens, namespace).pipeline

    def route(self, tokens: Sequence[int], namespace: str = "",
              usable: Sequence[int] | None = None, pinned: int | None = None) -> Route:
        """The pipeline for this request (`pinned`, else among `usable`, default all; all
        when none is), counted as in flight until `finished`, and the one holding a
        longer prefix."""
        digests = self._digests(tokens, namespace)
        with self._lock:
            if pinned is not None and not 0 <= pinned < len(self.load):
                raise ValueError(f"no pipeline {pinned}: there are {len(self.load)}")
            live = [p for p in range(len(self.load)) if p not in self.retired]
            candidates = [pinned] if pinned is not None else \
                [p for p in (usable or ()) if p in live] or live
            held = self._held(digests)
            idlest = min(candidates, key=lambda p: (self.load[p], p))
            best, best_len = idlest, 0
            for p in candidates:
                if self.load[p] - self.load[idlest] > self.max_imbalance:
                    continue
                length = held[p]
                if length > best_len or (length == best_len and length
                                         and self.load[p] < self.load[best]):
                    best, best_len = p, length
            holder = max(held, key=lambda p: (held[p], p == best))
            self.load[best] += 1
            seen = self._seen[best]
            for d in digests.values():
                seen[d] = None
                seen.move_to_end(d)
            while len(seen) > REMEMBERED:
                seen.popitem(last=False)
            return Route(best, holder if held[holder] > best_len else None)

    def holder(self, tokens: Sequence[int], namespace: str = "",
               exclude: int | None = None) -> int | None:
        """The pipeline (other than `exclude`) that served the longest prefix of these
        tokens; None where none did."""
        digests = self._digests(tokens, namespace)
        with self._lock:
            held = {p: n for p, n in self._held(digests).items() if p != exclude and n}
        return max(held, key=held.get) if held else None

    def _held(self, digests: dict[int, bytes]) -> dict[int, int]:
        """Per pipeline, the longest of these prefixes it served (0: none); under the lock."""
        longest_first = sorted(digests, reverse=True)
        return {p: next((n for n in longest_first if digests[n] in seen), 0)
                for p, seen in enumerate(self._seen)}

    def finished(self, pipeline: int) -> None:
        with self._lock:
            self.load[pipeline] -= 1
