"""The runs going on now, for the status page: each choice's run from its start to its
close, read as it goes (age, tokens, time to first token, decode speed). Each caller sees
its own tenant's runs only: another tenant's list would tell when and how much it asks,
and how much of it was cached (the total running is the admission gauge)."""

from __future__ import annotations

import itertools
import time
from typing import Protocol


class _Run(Protocol):
    tenant: str  # the caller's key's tag ("" on a server without keys)

    def figures(self, now: float) -> dict: ...


class InFlight:
    """Runs register at their start and leave at their close (both on the event loop,
    where the snapshot is read too: no lock)."""

    def __init__(self):
        self._runs: dict[int, tuple[int, _Run]] = {}
        self._ids = itertools.count(1)

    def add(self, run: _Run) -> None:
        self._runs.setdefault(id(run), (next(self._ids), run))

    def remove(self, run: _Run) -> None:
        self._runs.pop(id(run), None)

    def __len__(self) -> int:
        return len(self._runs)

    def snapshot(self, tenant: str) -> list[dict]:
        """`tenant`'s runs now, oldest first, with their numbers (counted from 1 per
        gateway, over every tenant)."""
        now = time.perf_counter()
        return [{"id": n, **run.figures(now)}
                for n, run in sorted(self._runs.values(), key=lambda e: e[0])
                if run.tenant == tenant]
