"""Restore only where it pays: what a restore and a recompute cost on this node.

A hit saves computing its rows but costs its restore: a copy in RAM, a read, a zstd
decompression and a BLAKE3 check from the disk tier. Both costs are measured as they
happen (seconds per prefill row, seconds per restored token by tier, smoothed), and a
hit is taken only when its restore is expected to take less time than the rows it saves
(the LibTorch log's rule: never restore when recompute is cheaper). Until both are
measured a restore is taken: on the machines we know it nearly always pays. Remote pulls
decide the same way with the link's bandwidth (mesh/stage/state_pull.py).
"""

from __future__ import annotations

import threading

SMOOTHING = 0.5  # weight of the newest measure


class RestoreCosts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.row_s: float | None = None          # prefill seconds per row
        self.token_s: dict[str, float] = {}      # tier -> restore seconds per token
        self.declined = 0                        # hits left for recompute

    def prefilled(self, rows: int, seconds: float) -> None:
        if rows > 0:
            with self._lock:
                self.row_s = _smooth(self.row_s, seconds / rows)

    def restored(self, tier: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            with self._lock:
                self.token_s[tier] = _smooth(self.token_s.get(tier), seconds / tokens)

    def pays(self, tier: str, tokens: int, saved_rows: int) -> bool:
        """Whether restoring `tokens` from `tier` beats computing the `saved_rows` rows it
        spares; counted in `declined` when it does not."""
        with self._lock:
            per_token = self.token_s.get(tier)
            if saved_rows <= 0:
                return False
            if per_token is None or self.row_s is None:
                return True
            if per_token * tokens < saved_rows * self.row_s:
                return True
            self.declined += 1
            return False


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old
