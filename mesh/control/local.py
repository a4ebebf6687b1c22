"""The in-process engine: a model's stages as objects in this process, linked by direct
calls instead of gRPC. Everything else — the stage sessions, compute loops and caches,
the request driver, admission — is the code `skippy serve` runs on Ray, so tests of this
engine test the served path."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from concurrent import futures
from pathlib import Path

from skippy.cache.config import CacheConfig
from skippy.proto import stage_pb2 as pb
from skippy.stages.runtime import StageSpec
from skippy.topology.capabilities import capability_for
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model
from skippy.stages.linear import held_bytes
from skippy.topology.planner import ModelFacts, PlanError, even_ranges, gguf_model_digest, \
    local_node, stage_bytes, topology_digest

from .engine import EngineInfo, GenerationRequest, Step
from ..stage.server import StageServer
from .pipelines import PipelinesEngine, node_figures, plan_figures

DEFAULT_LANES = 8
# Sessions block a thread while their stage computes; the default executor's few
# threads would cap how many rows a decode step can gather.
_SESSIONS = futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="session")


class LocalLink:
    """A stage's session at the next stage, by direct call."""

    def __init__(self, server: StageServer):
        self._session = server.open_session()
        self._lock = threading.Lock()  # a call and the close never overlap

    def ask(self, call: pb.StageCall) -> pb.StageResult:
        with self._lock:
            return self._session.handle(call)

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

    def __init__(self, servers: list[StageServer]):
        self.servers = servers
        self.generation = 0
        self.healthy = True
        self.addresses: list[str] = []  # in-process stages take no peer calls
        for here, after in zip(servers, servers[1:]):
            here.link_next(lambda after=after: LocalLink(after))

    async def open(self) -> AsyncLocalLink:
        return AsyncLocalLink(self.servers[0])

    async def repair(self, generation: int) -> None:
        if self.generation == generation:
            self.generation += 1


class InProcessEngine(PipelinesEngine):
    def __init__(self, model_path: str | Path, n_stages: int = 1, *,
                 cache: CacheConfig | None = None, runtime: str = "torch",
                 wire_dtype: str = "f16", model_name: str | None = None,
                 ranges: list[tuple[int, int]] | None = None, lanes: int = DEFAULT_LANES,
                 policy: str | None = None, **spec_options):
        """`policy` overrides the family's cache policy (tests of the payload path on a
        dense model)."""
        path = Path(model_path)
        f = open_model(path)
        config, policy = ModelConfig.from_gguf(f), policy or capability_for(f).policy
        model_digest = gguf_model_digest(f)
        f.close()
        self.cache = cache or CacheConfig()
        spec_options.setdefault("chunk", self.cache.chunk)
        ranges = ranges or even_ranges(config.n_layers, n_stages, config.cut_groups())
        n, split = len(ranges), topology_digest(model_digest, ranges, wire_dtype)
        servers = [StageServer(StageSpec(str(path), a, b, i, n, wire_dtype,
                                         topology_digest=split, **spec_options),
                               self.cache, policy, runtime)
                   for i, (a, b) in enumerate(ranges)]
        self.servers = servers
        # Loop threads hold their stages: they end with the engine (or its close).
        self._stop = weakref.finalize(self, _stop_loops, servers)
        self._serve([InProcessPipeline(servers)], lanes, self.cache.stride)
        self._plan = _plan(path, model_digest, servers, runtime, lanes)
        self.info = EngineInfo(model=model_name or path.stem, path=str(path),
                               n_ctx=servers[0].runtime.n_ctx, n_stages=n,
                               topology_digest=split, lanes=lanes,
                               extra={"runtime": runtime, "policy": policy, "pipelines": 1})

    def complete(self, tokens, max_tokens: int, **fields) -> list[Step]:
        """A request's steps, run to the end from synchronous code (tests, the CLI)."""
        request = GenerationRequest(tuple(tokens), max_tokens, **fields)

        async def run():
            return [step async for step in self.generate(request)]
        return asyncio.run(run())

    def stats(self) -> dict:
        stages = self._with_free_lanes([s.stats() for s in self.servers])
        return {"stages": stages, "nodes": node_figures(("local", s) for s in stages),
                "plan": self._plan, **self._figures()}

    async def close(self) -> None:
        self._stop()


def _plan(path: Path, model_digest: str, servers: list[StageServer], runtime: str,
          lanes: int) -> dict:
    """The stages on this machine and the memory each reserves (the planner's figures
    for these ranges: weights in the stages' format, KV for the lane budget)."""
    spec = servers[0].spec
    held = None if runtime != "torch" else \
        functools.partial(held_bytes, spec.weight_format)
    facts = ModelFacts.from_gguf(path, tensor_bytes=held, model_digest=model_digest)
    ranges = [(s.spec.layer_start, s.spec.layer_end) for s in servers]
    sizes = stage_bytes(facts, ranges, n_ctx=servers[0].runtime.n_ctx, lanes=lanes)
    try:
        node = local_node()
        here = (node.name, node.memory, node.cpus)
    except PlanError:
        here = ("local", None, os.cpu_count())
    return plan_figures([here], [(0, i, "local", a, b, w, kv, 0)
                                 for i, ((a, b), (w, kv)) in enumerate(zip(ranges, sizes))])


def _stop_loops(servers: list[StageServer]) -> None:
    for s in servers:
        s.loop.stop()
