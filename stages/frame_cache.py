"""A non-final stage's activation frames: the rows [0, b) it sent downstream for an
admitted prefix. When this stage can start at b but the next one must start earlier,
rows [d, b) come from here instead of being recomputed.

Not thread-safe: owned by one StageCache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skippy.cache.activation import ActivationCache
from skippy.cache.config import CacheConfig
from skippy.cache.identity import page_id, prefix_digest

from .cache_scope import CacheScope
from .frame import Frame
from .runtime import StageError


class StageFrames:
    def __init__(self, config: CacheConfig, width: int, keep: bool):
        """width: a frame row's width (the hidden size); keep: frames are kept (else
        this only cuts what a prefill computed to what the next stage needs)."""
        self.config, self.width = config, width
        self.store = ActivationCache(config.activation_max_entries,
                                     config.activation_max_bytes) \
            if keep and config.activation_max_bytes else None

    def cached(self, tokens: Sequence[int], start: int, scope: CacheScope) -> Frame | None:
        """Rows [0, L) for some recorded L >= start, cut to [0, start); None if absent."""
        if self.store is None or scope.probe or not start:
            return None
        lengths = sorted({start, *(b for b in self.config.record_lengths(len(tokens))
                                   if b > start)})
        for b in lengths:
            frame = self.store.get_frame(_key(scope, tokens, b), self.width)
            if frame is not None:
                return _rows(frame, 0, start)
        return None

    def after_prefill(self, tokens: Sequence[int], start: int, frame: Frame,
                      boundaries: list[int], scope: CacheScope,
                      downstream: int | None) -> Frame:
        """Record the frame at the admitted boundaries; the frame to send: rows
        [downstream, n) (default [start, n)), the earlier ones from this cache."""
        n = len(tokens)
        earlier = None
        if start and (boundaries or (downstream is not None and downstream < start)):
            earlier = self.cached(tokens, start, scope)
        whole = _join(earlier, frame, start)  # rows [0, n) when the cache had [0, start)
        if boundaries and whole is not None:
            self._record(tokens, boundaries, whole, scope)
        if downstream is None or downstream == start:
            return frame
        if downstream > start:
            return _rows(frame, downstream, n)
        if whole is None:
            raise StageError(f"no cached frame rows [{downstream}, {start})")
        return _rows(whole, downstream, n)

    def _record(self, tokens: Sequence[int], boundaries: list[int], whole: Frame,
                scope: CacheScope) -> None:
        """Keep rows [0, b) at the longest admitted boundary (shorter ones are cut from it)."""
        b = max(boundaries)
        if self.store is None or whole.end < b:
            return
        frame = _rows(whole, 0, b)
        nbytes = frame.rows.numel() * frame.rows.element_size() + (
            0 if frame.scale is None else frame.scale.numel() * 4)
        self.store.put_frame(_key(scope, tokens, b), self.width, frame, nbytes)

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()


def _key(scope: CacheScope, tokens: Sequence[int], b: int) -> str:
    return page_id(prefix_digest(scope.key, tokens[:b]))


def _rows(frame: Frame, a: int, b: int) -> Frame:
    """Positions [a, b) of a frame that covers them."""
    i, j = a - frame.start, b - frame.start
    if i < 0 or j > frame.n_rows:
        raise StageError(f"frame rows [{frame.start}, {frame.end}) do not cover [{a}, {b})")
    return Frame(a, frame.rows[i:j], None if frame.scale is None else frame.scale[i:j])


def _join(earlier: Frame | None, later: Frame, start: int) -> Frame | None:
    """Rows [0, later.end) from cached rows [0, start) and computed rows [start, ...);
    the computed rows alone when they start at 0, else None."""
    if later.start == 0:
        return later
    if earlier is None or earlier.end != start or later.start != start:
        return None
    if (earlier.scale is None) != (later.scale is None):
        return None
    scale = None if later.scale is None else torch.cat([earlier.scale, later.scale])
    return Frame(0, torch.cat([earlier.rows, later.rows]), scale)
