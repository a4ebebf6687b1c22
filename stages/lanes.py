"""A stage's request lanes: the runtime's alloc/free, what each lane's rows hold, and the
finished lanes kept warm for a follow-up.

A cache policy never sees these: it decides how entries are held and restored, while a
lane here is one request's slot (a follow-up continues in it when it still holds the
prompt). Lanes that hold cache entries (resident KV) are the policy's, not listed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .runtime import StageError, StageRuntime


@dataclass
class LaneInfo:
    tokens: list[int] = field(default_factory=list)  # the tokens its rows hold
    namespace: str = ""                              # whose tokens they are


class Lanes:
    def __init__(self, runtime: StageRuntime, max_warm: int | None,
                 keep: Callable[[int, LaneInfo], bool] | None = None):
        """max_warm: finished lanes kept warm at most (None: as many as the runtime
        has, each given up when a fresh lane is needed). keep(lane, info): offered a
        lane pushed past max_warm before it is freed; True when it took the lane (the
        cache keeps it as an entry)."""
        self.runtime, self.max_warm, self._keep = runtime, max_warm, keep
        self._info: dict[int, LaneInfo] = {}
        self._warm: dict[int, None] = {}  # idle lanes that keep their rows, oldest first

    def info(self, lane: int) -> LaneInfo:
        return self._info[lane]

    def hold(self, lane: int, tokens, namespace: str) -> None:
        """The lane's rows now hold `tokens` of `namespace`."""
        info = self._info[lane]
        info.tokens, info.namespace = list(tokens), namespace

    @property
    def warm(self) -> int:
        return len(self._warm)

    @property
    def busy(self) -> int:
        """Lanes a request holds now (allocated and not kept warm)."""
        return len(self._info) - len(self._warm)

    def warm_lanes(self) -> list[int]:
        """The idle lanes that keep their rows, oldest first."""
        return list(self._warm)

    def alloc(self, reuse: Callable[[int], int]) -> int:
        """The warm lane with the largest `reuse(lane)` (> 0), else a fresh lane; a
        runtime out of lanes gives up its oldest warm lane. Raises StageError when
        none is left at all."""
        best, most = None, 0
        for lane in self._warm:
            n = reuse(lane)
            if n > most:
                best, most = lane, n
        if best is not None:
            del self._warm[best]
            return best
        while True:
            try:
                lane = self.runtime.alloc_lane()
                break
            except StageError:
                if not self._warm:
                    raise
                self._free(next(iter(self._warm)))
        self._info[lane] = LaneInfo()
        return lane

    def release(self, lane: int, *, keep_warm: bool) -> None:
        """The request is over: keep the lane warm (if its rows hold anything) or free it."""
        info = self._info.get(lane)
        if keep_warm and info is not None and info.tokens:
            self._warm[lane] = None
            while self.max_warm is not None and len(self._warm) > self.max_warm:
                oldest = next(iter(self._warm))
                if self._keep is not None and self._keep(oldest, self._info[oldest]):
                    del self._warm[oldest]
                    del self._info[oldest]
                else:
                    self._free(oldest)
            return
        self._free(lane)

    def drop_warm(self, keep: int = 0) -> None:
        """Free warm lanes, oldest first, down to `keep`."""
        while len(self._warm) > keep:
            self._free(next(iter(self._warm)))

    def _free(self, lane: int) -> None:
        self._warm.pop(lane, None)
        self._info.pop(lane, None)
        self.runtime.free_lane(lane)
