"""The runs going on now, for the status page: each choice's run from its start to its
close, read as it goes (age, tokens, time to first token, decode speed), and each
tenant's totals of the runs that ended. Each caller sees its own tenant's runs and totals
only: another tenant's would tell when and how much it asks, and how much of it was
cached (the total running is the admission gauge)."""

from __future__ import annotations

import itertools
import time
from typing import Protocol

_TOTALS = ("choices", "prompt_tokens", "cached_tokens", "completion_tokens")


class _Run(Protocol):
    tenant: str  # the caller's key's tag ("" on a server without keys)

    def figures(self, now: float) -> dict: ...


class InFlight:
    """Runs register at their start and leave at their close (both on the event loop,
    where the snapshot is read too: no lock)."""

    def __init__(self):
        self._runs: dict[int, tuple[int, _Run]] = {}
        self._ids = itertools.count(1)
        self._totals: dict[str, dict[str, int]] = {}  # tenant: the runs that ended

    def add(self, run: _Run) -> None:
        self._runs.setdefault(id(run), (next(self._ids), run))

    def remove(self, run: _Run) -> None:
        self._runs.pop(id(run), None)

    def ended(self, tenant: str, prompt_tokens: int, cached_tokens: int,
              completion_tokens: int) -> None:
        """A run of `tenant` ended; its prompt is counted by one run of the n that share
        it (0 tokens from the others), as a response's usage counts it."""
        totals = self._totals.setdefault(tenant, dict.fromkeys(_TOTALS, 0))
        totals["choices"] += 1
        totals["prompt_tokens"] += prompt_tokens
        totals["cached_tokens"] += cached_tokens
        totals["completion_tokens"] += completion_tokens

    def usage(self, tenant: str) -> dict[str, int]:
        """`tenant`'s totals over the runs that ended (zeros before any)."""
        return dict(self._totals.get(tenant) or dict.fromkeys(_TOTALS, 0))

    def __len__(self) -> int:
        return len(self._runs)

    def snapshot(self, tenant: str) -> list[dict]:
        """`tenant`'s runs now, oldest first, with their numbers (counted from 1 per
        gateway, over every tenant)."""
        now = time.perf_counter()
        return [{"id": n, **run.figures(now)}
                for n, run in sorted(self._runs.values(), key=lambda e: e[0])
                if run.tenant == tenant]
