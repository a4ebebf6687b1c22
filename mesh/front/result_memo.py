"""Gateway exact results: the tokens a deterministic request already produced.

A request is deterministic when it is greedy (temperature 0) or seeded: the same prompt,
sampling settings, end-of-generation ids, cache namespace and split (topology digest)
give the same token stream, whatever max_tokens is. So a run that stopped early still
gives a usable prefix of that stream, and a later request is answered from it when it
needs no token beyond it. Stop *strings* are not part of the key: they only cut the
text the gateway derives from the tokens, and the gateway applies them again on replay.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from skippy.cache.keyed import KeyedCache
from skippy.cache.telemetry import CacheStats

from ..control.engine import GenerationRequest

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 64 * 2**20
_ENTRY_OVERHEAD = 256  # key tuple, value object, dict slots: a rough per-entry cost


@dataclass(frozen=True)
class KnownRun:
    tokens: tuple[int, ...]   # the stream's first tokens, in order
    complete: bool            # the stream ended there (an end-of-generation id came next)


def memo_key(request: GenerationRequest, topology_digest: str) -> Hashable | None:
    """The identity of a request's token stream, or None when it is not reproducible or
    asks for log-probabilities (the memo keeps tokens only)."""
    if request.probe or not request.sampling.deterministic \
            or request.sampling.logprobs is not None:
        return None
    return (topology_digest, request.namespace, request.sampling,
            tuple(sorted(request.stop_ids)), request.tokens)


class ResultMemo:
    """Bounded (entries and bytes, LRU) map from memo_key to the longest KnownRun."""

    kind = "gateway-result"

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self._cache = KeyedCache(max_entries, max_bytes)
        self._cache.kind = self.kind

    def get(self, key: Hashable | None) -> KnownRun | None:
        return None if key is None else self._cache.get(key)

    def record(self, key: Hashable | None, run: KnownRun, known: KnownRun | None) -> None:
        """Keep `run` when it knows more than `known` (what `get` gave this request).

        KeyedCache counts every lookup, so there is no free peek: a run recorded by a
        concurrent request in the meantime is kept, even if shorter (rare, harmless)."""
        if key is None or (not run.tokens and not run.complete):
            return
        if known is not None:
            if known.complete or (len(known.tokens) >= len(run.tokens) and not run.complete):
                return
            self._cache.remove(key)  # KeyedCache.put keeps an existing value
        nbytes = 8 * (len(key[-1]) + len(run.tokens)) + _ENTRY_OVERHEAD
        self._cache.put(key, run, nbytes)

    def stats(self) -> CacheStats:
        return self._cache.stats()

    def __len__(self) -> int:
        return len(self._cache)
