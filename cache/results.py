"""Exact decoded results: an identical whole prompt gets back what its last run computed
(the next-token logits of the last stage) without running its last token again.

The key covers the stage and every prompt token and is tagged apart from prefix keys,
so a whole-prompt entry never serves as the prefix of a longer prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from .identity import prefix_digest
from .keyed import KeyedCache

_EXACT_TAG = b"skippy-exact-prompt/1"


def exact_prompt_key(stage: bytes, tokens: Sequence[int]) -> bytes:
    return blake3.blake3(_EXACT_TAG + prefix_digest(stage, tokens)).digest()


class ExactResults(KeyedCache):
    kind = "exact-result"

    def get_result(self, stage: bytes, tokens: Sequence[int], *, probe: bool = False):
        return self.get(exact_prompt_key(stage, tokens), probe=probe)

    def put_result(self, stage: bytes, tokens: Sequence[int], value, nbytes: int) -> bool:
        return self.put(exact_prompt_key(stage, tokens), value, nbytes)
