"""Several models behind one gateway: which are loaded, loading one on demand, and which
idle one goes when memory is short (llama-server's router mode, on our stages).

Each model is a `ModelSlot`: its name, what loads it (an engine), and the memory its plan
holds (every stage's weights, KV and overhead). A request holds its model's slot from
arrival to its last byte; a model that no request holds is idle. Loading one that does
not fit (the set's memory budget, or the cluster's own memory, which the planner checks
against what the loaded models hold) first unloads idle models, least recently used
first; if only models in use are left to unload, the request waits a while for one to
go idle, then gets a 503. A model idle past `idle_unload_s` is unloaded even without
pressure, so its memory goes back to the node's other users.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from skippy.topology.errors import OverCapacity
from skippy.topology.planner import PlanError

from .engine import Engine, EngineInfo

log = logging.getLogger(__name__)

WAIT_S = 10.0   # a request for a model that does not fit waits this long for an idle one
POLL_S = 0.05


class UnknownModel(LookupError):
    """A request named a model this gateway does not serve."""

    def __init__(self, asked: str, served: list[str]):
        self.asked, self.served = asked, served
        super().__init__(f"the model '{asked}' is not served here")


@dataclass
class ModelSlot:
    """One model of the set: `load()` builds its engine (blocking: it runs in a thread),
    `size()` the bytes its plan holds (planned without loading)."""

    name: str
    load: Callable[[], Engine]
    size: Callable[[], int] = lambda: 0
    engine: Engine | None = None
    users: int = 0                 # requests holding it now
    last_used: float = 0.0         # monotonic time its last request ended
    loads: int = 0                 # times it was loaded (the first included)
    _bytes: int | None = field(default=None, repr=False)

    @property
    def bytes(self) -> int:
        if self._bytes is None:
            self._bytes = int(self.size())
        return self._bytes


class ModelSet:
    """The models one gateway serves (the first is the default for requests that name
    none); see the module docstring."""

    def __init__(self, slots: list[ModelSlot], *, budget_bytes: int | None = None,
                 idle_unload_s: float | None = None, wait_s: float = WAIT_S,
                 say: Callable[[str], None] = log.info):
        """`wait_s`: how long a request for a model that does not fit waits for one in
        use to go idle (then a 503)."""
        names = [s.name for s in slots]
        if not slots or len(set(names)) != len(names):
            raise ValueError(f"a model set needs models with distinct names, not {names}")
        self.slots = {s.name: s for s in slots}
        self.budget_bytes, self.idle_unload_s, self._say = budget_bytes, idle_unload_s, say
        self.wait_s = wait_s
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._reaper: asyncio.Task | None = None

    @classmethod
    def of(cls, engine: Engine) -> ModelSet:
        """One model, loaded already (a gateway over one engine)."""
        slot = ModelSlot(engine.info.model, lambda: engine, engine=engine, loads=1)
        return cls([slot])

    @property
    def default(self) -> str:
        return next(iter(self.slots))

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots.values() if s.engine is not None]

    def slot(self, name: str | None) -> ModelSlot:
        """The slot `name` names (None: the default); UnknownModel otherwise."""
        slot = self.slots.get(self.default if name is None else name)
        if slot is None:
            raise UnknownModel(str(name), self.names)
        return slot

    async def hold(self, name: str | None) -> tuple[Engine, Callable[[], None]]:
        """`name`'s engine, loaded first where it is not (unloading idle models to make
        room), and what ends this hold (once). While held, the model is never unloaded."""
        slot = self.slot(name)
        slot.users += 1
        try:
            engine = slot.engine or await asyncio.shield(self._load(slot))
        except BaseException:
            self._end(slot)
            raise
        self._start_reaper()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._end(slot)
        return engine, release

    def _end(self, slot: ModelSlot) -> None:
        slot.users -= 1
        slot.last_used = time.monotonic()

    def load_at_start(self) -> None:
        """The models in their order while they fit (before serving; blocking): the first
        always (its failure is the start's), the rest until one would need an unload."""
        first, *rest = self.slots.values()
        self._load_now(first)
        for slot in rest:
            if self.budget_bytes is not None and \
                    self._held() + slot.bytes > self.budget_bytes:
                self._say(f"model {slot.name} loads on its first request "
                          f"({_gib(slot.bytes)}; the budget holds {_gib(self.budget_bytes)})")
                continue
            try:
                self._load_now(slot)
            except PlanError as e:
                self._say(f"model {slot.name} loads on its first request: {e}")

    async def _load(self, slot: ModelSlot) -> Engine:
        async with self._lock:
            if slot.engine is not None:
                return slot.engine
            if self.budget_bytes is not None:
                if slot.bytes > self.budget_bytes:
                    raise OverCapacity(f"model {slot.name} needs {_gib(slot.bytes)}, more "
                                       f"than the models' budget of "
                                       f"{_gib(self.budget_bytes)}")
                while self._held() + slot.bytes > self.budget_bytes:
                    await self._unload_idle_one(slot)
            while True:  # the cluster's own memory: the planner says when it is short
                try:
                    return await asyncio.to_thread(self._load_now, slot)
                except PlanError:
                    if not any(s is not slot for s in self.loaded()):
                        raise  # it does not fit alone: the start said so already
                    await self._unload_idle_one(slot)

    def _load_now(self, slot: ModelSlot) -> Engine:
        t = time.monotonic()
        self._say(f"loading model {slot.name} ...")
        engine = slot.load()
        slot.engine, slot.loads = engine, slot.loads + 1
        slot.last_used = time.monotonic()
        self._say(f"model {slot.name} loaded in {time.monotonic() - t:.1f} s")
        return engine

    def _idle(self, keep: ModelSlot) -> list[ModelSlot]:
        """Loaded models no request holds (but `keep`), least recently used first."""
        return sorted((s for s in self.loaded() if s.users == 0 and s is not keep),
                      key=lambda s: s.last_used)

    async def _unload_idle_one(self, wanted: ModelSlot) -> None:
        """The least recently used idle model goes, waiting up to `wait_s` for one in
        use to go idle."""
        deadline = time.monotonic() + self.wait_s
        while not (idle := self._idle(wanted)):
            if time.monotonic() >= deadline:
                busy = ", ".join(s.name for s in self.loaded() if s is not wanted)
                raise OverCapacity(f"model {wanted.name} does not fit while {busy} "
                                   f"serve(s) requests; retry later")
            await asyncio.sleep(POLL_S)
        await self._unload(idle[0], f"to make room for {wanted.name}")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        engine, slot.engine = slot.engine, None
        self._say(f"unloading model {slot.name} ({why})")
        if engine is not None:
            await engine.close()

    def _held(self) -> int:
        return sum(s.bytes for s in self.loaded())

    def _start_reaper(self) -> None:
        if self.idle_unload_s is not None and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Unload models idle past `idle_unload_s`, checked a few times per bound."""
        while True:
            await asyncio.sleep(max(0.05, self.idle_unload_s / 4))
            now = time.monotonic()
            async with self._lock:
                for slot in self._idle(None):
                    if now - slot.last_used >= self.idle_unload_s:
                        await self._unload(slot, f"idle {now - slot.last_used:.0f} s")

    # -- what the gateway's figures read ------------------------------------------------
    def info(self, name: str | None = None) -> EngineInfo | None:
        slot = self.slot(name)
        return slot.engine.info if slot.engine is not None else None

    def status(self) -> dict:
        """Serving while every loaded model can (an unloaded one loads on demand)."""
        out = [(s.name, s.engine.status()) for s in self.loaded()]
        if len(self.slots) == 1 and out:
            return out[0][1]
        down = [f"{name}: {st.get('detail', '')}" for name, st in out if not st["serving"]]
        return {"serving": not down,
                "detail": "; ".join(down) or f"{len(out)} of {len(self.slots)} model(s) "
                                              f"loaded"}

    def stats(self) -> dict:
        """The loaded engines' figures; with several models, each stage (and plan row)
        says its model, and the engine-wide numbers are added up."""
        loaded = self.loaded()
        if len(self.slots) == 1:
            return loaded[0].engine.stats() if loaded else {}
        out: dict = {"stages": [], "plan": {"nodes": [], "stages": []}, "nodes": {},
                     "models": self.figures()}
        for slot in loaded:
            stats = slot.engine.stats()
            out["stages"] += [{**st, "model": slot.name, "index": i,
                               "label": f"{slot.name}/{i}"}
                              for i, st in enumerate(stats.get("stages", []))]
            plan = stats.get("plan") or {}
            out["plan"]["stages"] += [{**row, "model": slot.name}
                                      for row in plan.get("stages", [])]
            out["plan"]["nodes"] += [n for n in plan.get("nodes", [])
                                     if n not in out["plan"]["nodes"]]
            for key in ("nodes", "admission", "rebuilds"):
                _add(out.setdefault(key, {}), stats.get(key) or {})
            if "recreated" in stats:
                out["recreated"] = out.get("recreated", 0) + stats["recreated"]
        return out

    def figures(self) -> list[dict]:
        return [{"model": s.name, "loaded": s.engine is not None, "in_use": s.users,
                 "loads": s.loads, "bytes": s.bytes if s._bytes is not None else None}
                for s in self.slots.values()]

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for slot in self.loaded():
            await self._unload(slot, "the gateway stops")


def _add(into: dict, more: dict) -> None:
    """Numbers added key by key, nested dicts too."""
    for k, v in more.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
