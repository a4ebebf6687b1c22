"""The in-process engine: a model's stages as objects in this process, linked by direct
calls instead of gRPC. Everything else — the stage sessions, compute loops and caches,
the request driver, admission — is the code `skippy serve` runs on Ray, so tests of this
engine test the served path."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from concurrent import futures
from pathlib import Path

from skippy.cache.config import CacheConfig
from skippy.proto import stage_pb2 as pb
from skippy.stages.runtime_kind import REFERENCE_FORMAT, TORCH, RuntimeKind
from skippy.topology.planner import DEFAULT_LANES, DEFAULT_N_CTX, NodeSpec, PlanError, \
    local_node

from .engine import GenerationRequest, Step
from ..stage.server import StageServer
from .pipelines import PipelinesEngine, node_figures
from .served_model import ServedModel

# Sessions block a thread while their stage computes; the default executor's few
# threads would cap how many rows a decode step can gather.
_SESSIONS = futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="session")


class LocalLink:
    """A stage's session at the next stage, by direct call; `hop_s`: a one-way delay
    each way (evals: a network's latency between hosts)."""

    def __init__(self, server: StageServer, hop_s: float = 0.0):
        self._session = server.open_session()
        self._lock = threading.Lock()  # a call and the close never overlap
        self._hop_s = hop_s

    def ask(self, call: pb.StageCall) -> pb.StageResult:
        with self._lock:
            if self._hop_s:
                time.sleep(self._hop_s)
            try:
                return self._session.handle(call)
            finally:
                if self._hop_s:
                    time.sleep(self._hop_s)

    def close(self) -> None:
        with self._lock:
            self._session.close()


class AsyncLocalLink:
    """The driver's session at stage 0, run on a session thread."""

    def __init__(self, server: StageServer):
        self._link = LocalLink(server)

    async def ask(self, call: pb.StageCall) -> pb.StageResult:
        return await asyncio.get_running_loop().run_in_executor(_SESSIONS, self._link.ask,
                                                                call)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(_SESSIONS, self._link.close)


class InProcessPipeline:
    """Stage servers chained by direct calls. In-process stages do not die: a fault is
    rebuilt on the same objects."""

    def __init__(self, servers: list[StageServer], hop_s: float = 0.0):
        self.servers = servers
        self.generation = 0
        self.healthy = True
        self.addresses: list[str] = []  # in-process stages take no peer calls
        for here, after in zip(servers, servers[1:]):
            here.link_next(lambda after=after: LocalLink(after, hop_s))

    async def open(self) -> AsyncLocalLink:
        return AsyncLocalLink(self.servers[0])

    async def repair(self, generation: int) -> None:
        if self.generation == generation:
            self.generation += 1


class InProcessEngine(PipelinesEngine):
    def __init__(self, model_path: str | Path, n_stages: int = 1, *,
                 cache: CacheConfig | None = None, runtime: RuntimeKind = TORCH,
                 wire_dtype: str = "f16", model_name: str | None = None,
                 ranges: list[tuple[int, int]] | None = None, lanes: int = DEFAULT_LANES,
                 n_ctx: int = DEFAULT_N_CTX, weight_format: str = REFERENCE_FORMAT,
                 policy: str | None = None, speculate: bool = True, hop_s: float = 0.0,
                 draft: str | Path | None = None, **spec_options):
        """The plan the Ray engine would make on one node, this machine (`ranges`: exactly
        those). `policy` overrides the family's cache policy (tests of the payload path on
        a dense model); `speculate`: decode steps verify proposed tokens (driver.py);
        `hop_s`: a one-way delay on every stage-to-stage message (evals of a pipeline
        across hosts); `draft`: a draft model's GGUF proposes the tokens; `spec_options` are the stages' other StageSpec fields."""
        self.cache = cache or CacheConfig()
        # Stages in this process need no process of their own: no per-stage overhead.
        self.model = ServedModel.open(model_path, runtime, lambda _digest: [_this_machine()],
                                      stages=n_stages, ranges=ranges, wire_dtype=wire_dtype,
                                      n_ctx=n_ctx, lanes=lanes, weight_format=weight_format,
                                      policy=policy, overhead_bytes=0)
        spec_options.setdefault("chunk", self.cache.chunk)
        servers = [StageServer(self.model.spec(i, **spec_options), self.cache,
                               self.model.policy, runtime)
                   for i in range(len(self.model.plan.stages))]
        self.servers = servers
        # Loop threads hold their stages: they end with the engine (or its close).
        self._stop = weakref.finalize(self, _stop_loops, servers)
        self._serve([InProcessPipeline(servers, hop_s)], lanes, self.cache.stride, speculate,
                    None if draft is None else Path(draft))
        self.info = self.model.info(model_name, lanes, pipelines=1)

    def complete(self, tokens, max_tokens: int, **fields) -> list[Step]:
        """A request's steps, run to the end from synchronous code (tests, the CLI)."""
        request = GenerationRequest(tuple(tokens), max_tokens, **fields)

        async def run():
            return [step async for step in self.generate(request)]
        return asyncio.run(run())

    def stats(self) -> dict:
        stages = self._with_free_lanes([s.stats() for s in self.servers])
        plan = self.model.figures([0], lambda _r, i: self.model.plan.stages[i].node.name)
        return {"stages": stages, "nodes": node_figures(("local", s) for s in stages),
                "plan": plan, **self._figures()}

    async def close(self) -> None:
        self._stop()


def _this_machine() -> NodeSpec:
    """This machine as the plan's one node; where its free memory cannot be read (no
    /proc/meminfo), one that refuses nothing."""
    try:
        return local_node()
    except PlanError:
        return NodeSpec("local", sys.maxsize, os.cpu_count() or 1)


def _stop_loops(servers: list[StageServer]) -> None:
    for s in servers:
        s.loop.stop()
