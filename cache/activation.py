"""Activation frames a non-final stage forwarded, kept to serve a downstream miss.

When this stage hits at boundary b but the next stage misses there, the rows [0, b) it
would have recomputed are sent from here instead. Keys follow the original:
`act:{page_id}:w{width}`, the prefix's page id and the frame's row width (hidden size).
"""

from __future__ import annotations

from .keyed import KeyedCache


def activation_key(page_id: str, width: int) -> str:
    return f"act:{page_id}:w{width}"


class ActivationCache(KeyedCache):
    kind = "activation"

    def get_frame(self, page_id: str, width: int, *, probe: bool = False):
        return self.get(activation_key(page_id, width), probe=probe)

    def put_frame(self, page_id: str, width: int, frame, nbytes: int) -> bool:
        return self.put(activation_key(page_id, width), frame, nbytes)
