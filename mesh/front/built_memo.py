"""Requests already built: the same body from the same caller to the same API and model
gives the same requests again (validating, rendering the chat template and tokenizing
are pure functions of them), so a repeated body skips all three. An exact repeat then
costs the gateway its HTTP and the exact-results memo only (result_memo.py).

Kept only where building is pure: completions, and chats whose template does not read
the clock (`strftime_now`: a date in the prompt changes with the day). The Responses API
reads stored responses, so its turns are always built again.
"""

from __future__ import annotations

from collections.abc import Hashable

import blake3

from skippy.cache.keyed import KeyedCache

from .openai_api import ParsedRequest
from .request_building import BuiltRequest

MAX_ENTRIES = 1024
MAX_BYTES = 32 * 2**20
_ENTRY_OVERHEAD = 1024  # the parsed request's objects beyond its text and token ids


class BuiltMemo:
    kind = "gateway-built"

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self._cache = KeyedCache(max_entries, max_bytes)
        self._cache.kind = self.kind

    @staticmethod
    def key(api: str, tenant: str, raw: bytes) -> Hashable:
        """A body's identity for one caller and API (a digest: the body is not kept)."""
        return api, tenant, blake3.blake3(raw).digest()

    def get(self, key: Hashable) -> tuple[ParsedRequest, BuiltRequest] | None:
        return self._cache.get(key)

    def put(self, key: Hashable, raw: bytes, parsed: ParsedRequest,
            built: BuiltRequest) -> None:
        tokens = sum(len(r.tokens) for r in built.requests)
        self._cache.put(key, (parsed, built), 2 * len(raw) + 8 * tokens + _ENTRY_OVERHEAD)

