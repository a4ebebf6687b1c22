"""Capacity that follows load and nodes: a pipeline more while requests wait for lanes
or when a node joins (where a whole copy fits), one added released once idle; and a
model that a lost node made cut anew goes back to the plan asked for once a node that
joins makes it fit again (the engine's `restore`).

Every pipeline runs the same plan (the same ranges, the same topology digest), so a new
one answers exactly as the others and takes new requests at once; a retired one takes no
new request, ends the ones it has, then its stages go. The engine says where a new
pipeline fits (`grow`: None where the cluster has no room for a whole copy; a node that
joined with room is where it goes). The pipelines the engine started with stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

TICK_S = 0.25   # how often the load is looked at
NODES_S = 2.0   # how often the cluster's nodes are counted (a joined one may hold a copy)


@dataclass(frozen=True)
class ScalingPolicy:
    min_pipelines: int             # the ones started with: never released
    max_pipelines: int
    wait_s: float = 2.0            # requests waiting for lanes this long: one pipeline more
    idle_s: float = 60.0           # an added pipeline idle this long is released


class Scalable(Protocol):
    admission: object              # .waiting: requests waiting for lanes
    router: object                 # .load: requests in flight per pipeline

    def live(self) -> list[int]: ...

    def nodes(self) -> int: ...

    def grow(self) -> Awaitable[int | None]: ...

    def restore(self) -> Awaitable[bool]: ...

    def ask_for_room(self, more: int = 0) -> object: ...

    def shrink(self, pipeline: int) -> Awaitable[None]: ...


class Scaler:
    def __init__(self, engine: Scalable, policy: ScalingPolicy,
                 say: Callable[[str], None] = log.info):
        self.engine, self.policy, self._say = engine, policy, say
        self._task: asyncio.Task | None = None
        self._waiting_since: float | None = None
        self._idle_since: dict[int, float] = {}
        self._no_room_until = 0.0
        self._nodes: int | None = None   # the alive nodes when last counted
        self._nodes_at = -NODES_S
        self.added = self.released = 0

    def start(self) -> None:
        """Watch the load from the running event loop on (once per loop: a test's
        asyncio.run calls each run a loop of their own)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 (a failed step is logged; serving goes on)
                log.exception("scaling step failed")

    async def tick(self, now: float) -> None:
        e, p = self.engine, self.policy
        live = e.live()
        joined = await self._joined(now)
        if joined and await e.restore():
            self._say("a node joined: the model is cut as asked at start again")
            return
        if joined and len(live) < p.max_pipelines:
            added = await e.grow()
            if added is not None:
                self.added += 1
                self._say(f"a node joined: pipeline {added} added ({len(live) + 1} serving)")
                return
        if e.admission.waiting and len(live) < p.max_pipelines and now >= self._no_room_until:
            if self._waiting_since is None:
                self._waiting_since = now
            if now - self._waiting_since >= p.wait_s:
                self._waiting_since = None
                added = await e.grow()
                if added is None:  # no room for a whole copy: look again later, and ask
                    # Ray's autoscaler, where one runs, for nodes (grow asks again once
                    # the copy is placed; a node that joins is used as any other)
                    self._no_room_until = now + 10 * p.wait_s
                    await asyncio.to_thread(e.ask_for_room, 1)
                else:
                    self.added += 1
                    self._say(f"requests wait for lanes: pipeline {added} added "
                              f"({len(live) + 1} serving)")
                return
        elif not e.admission.waiting:
            self._waiting_since = None
        for q in sorted(live[p.min_pipelines:], reverse=True):  # the newest first
            if e.router.load[q]:
                self._idle_since.pop(q, None)
                continue
            since = self._idle_since.setdefault(q, now)
            if now - since >= p.idle_s and not e.admission.waiting:
                self._idle_since.pop(q)
                await e.shrink(q)
                self.released += 1
                self._say(f"pipeline {q} idle {now - since:.0f} s: released "
                          f"({len(live) - 1} serving)")
                return

    async def _joined(self, now: float) -> bool:
        """Whether the cluster has more alive nodes than when last counted (every
        NODES_S); the first count only sets the mark."""
        if now - self._nodes_at < NODES_S:
            return False
        self._nodes_at = now
        n = await asyncio.to_thread(self.engine.nodes)
        joined = self._nodes is not None and n > self._nodes
        self._nodes = n
        return joined

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
