"""The mesh engine: stage actors placed by Ray, requests routed over gRPC.

Ray is the control plane: it places one `StageActor` per planned stage (pinned to the
planned node), restarts dead ones and carries figures back. The router pins a request
to the pipeline for its whole life: it opens one gRPC stream to stage 0, plans,
prefills, then sends each sampled token back to stage 0 for the next decode step. The
last stage samples, so logits never cross the network.

A stage that dies costs time, never the request: the router holds the token history,
waits for Ray to restart the actor, reconnects the chain and rebuilds the request's
state by prefilling prompt + tokens so far (restored from caches where they survive).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from skippy.cache.config import CacheConfig
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc
from skippy.stages.linear import held_bytes
from skippy.stages.runtime import StageSpec
from skippy.topology.capabilities import capability_for
from skippy.topology.model_package import is_package, open_model
from skippy.topology.planner import ModelFacts, NodeSpec, Plan, plan

from .engine import EngineBusy, EngineError, EngineInfo, GenerationRequest, Step, check_fits
from .router import Router
from .wire import sampling_to_proto, token_logprobs

log = logging.getLogger(__name__)

RESTARTS = 3            # a stage actor comes back this many times
REBUILD_ATTEMPTS = 3    # a request survives this many stage failures
ACTOR_START_TIMEOUT = 900


def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join `address`, or start a light embedded Ray (DESIGN.md §9). True if we started it."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False)
    return True


# OpenMP's idle workers spin this many times before they sleep (libgomp's default is
# about 300,000). A stage bursting to more threads leaves workers idle while the next
# stage computes, and their spinning took that stage's cores: 2 SmolLM2 int4 stages
# on 2 cores, two threads each, 29-32 ms a token at the default, 16-17 at 10,000.
GOMP_SPINCOUNT = "10000"


def stage_env() -> dict[str, str]:
    """Environment of the stage actors; a user's own OpenMP wait settings win."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}


@ray.remote(num_cpus=0)
def _layers_here(package: str, model_digest: str) -> list[int]:
    from skippy.topology.model_package import layers_present
    return sorted(layers_present(package, model_digest))


def cluster_nodes(package: Path | None = None, model_digest: str = "") -> list[NodeSpec]:
    """The alive Ray nodes as planner nodes; the name is the Ray node id. Serving a
    package, each node also says which layers' parts it holds at the same path, so the
    planner can put stages where their parts are."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = dict(n.get("Resources", {}))
        out.append(NodeSpec(name=n["NodeID"], memory=int(res.pop("memory", 0)),
                            cpus=int(res.pop("CPU", 1)),
                            resources={k: v for k, v in res.items()
                                       if not k.startswith(("node:", "object_store"))}))
    if package is None:
        return out
    asks = [_layers_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node.name, soft=False)).remote(str(package), model_digest) for node in out]
    held = ray.get(asks, timeout=60)
    return [dataclasses.replace(node, layers=frozenset(layers))
            for node, layers in zip(out, held)]


class _Pipeline:
    """One actor per stage, chained: stage i knows where stage i + 1 listens."""

    def __init__(self, actors: list):
        self.actors = actors
        self.addresses: list[str] = []
        self._channels: dict[int, tuple] = {}  # event loop -> (channel, stub, address)

    def wire(self) -> list[str]:
        """Every stage's address (waiting for restarts), each told the next one's."""
        addresses = ray.get([a.address.remote() for a in self.actors],
                            timeout=ACTOR_START_TIMEOUT)
        ray.get([a.connect.remote(addresses[i + 1] if i + 1 < len(addresses) else None)
                 for i, a in enumerate(self.actors)], timeout=60)
        self.addresses = addresses
        return addresses

    def stub(self) -> stage_pb2_grpc.StageStub:
        """A channel to stage 0 for the running event loop (grpc.aio binds to one loop)."""
        loop = id(asyncio.get_running_loop())
        entry = self._channels.get(loop)
        if entry is None or entry[2] != self.addresses[0]:
            channel = grpc.aio.insecure_channel(self.addresses[0])
            entry = self._channels[loop] = (channel, stage_pb2_grpc.StageStub(channel),
                                            self.addresses[0])
        return entry[1]

    async def close(self) -> None:
        for channel, *_ in self._channels.values():
            try:
                await channel.close()
            except Exception:  # its event loop may be gone already
                pass
        self._channels.clear()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


class RayEngine:
    def __init__(self, model_path: str | Path, n_stages: int | None = None, *,
                 pipelines: int = 1, model_name: str | None = None,
                 address: str | None = None, cache: CacheConfig | None = None,
                 runtime: str = "torch", wire_dtype: str = "f16", n_ctx: int = 8192,
                 threads: int | None = None, weight_format: str = "fp32",
                 lane_batch: int = 1, progress: Callable[[str], None] = log.info):
        if pipelines < 1:
            raise ValueError(f"pipelines must be at least 1, not {pipelines}")
        path = Path(model_path)
        self._owns_ray = start_ray(address)
        self.cache = cache or CacheConfig()
        f = open_model(path)
        policy = capability_for(f).policy
        f.close()
        held = None if runtime != "torch" else functools.partial(held_bytes, weight_format)
        facts = ModelFacts.from_gguf(path, tensor_bytes=held)
        n_ctx = min(n_ctx, facts.context_length or n_ctx)
        # Every pipeline uses the same plan: the same ranges compute the same numbers, so
        # one topology digest names them all (the gateway's exact results rely on it).
        nodes = cluster_nodes(path if is_package(path) else None, facts.model_digest)
        self.plan: Plan = plan(facts, nodes, wire_dtype=wire_dtype, n_ctx=n_ctx,
                               stages=n_stages, lanes=4 * pipelines)
        n = len(self.plan.stages)
        progress(f"plan: {n} stage(s) x {pipelines} pipeline(s), "
                 f"topology {self.plan.digest[:16]}")
        from .stage_actor import StageActor
        # Stages sharing a node share its cores: with concurrent requests they all compute
        # at once, and OpenMP teams larger than their share of the cores stall each other.
        # Two SmolLM2 int4 stages on 2 cores, 8 clients: 57 tokens/s at one thread each,
        # 19 at two.
        # One session alone keeps a pipeline's stages computing in turn: each may then use
        # all of its pipeline's cores on the node (stage_service.py). SmolLM2 int4, 2
        # stages on 2 cores: 16.9-17.7 ms a token alone (was 21.6-23; one stage 14.9-15.3),
        # 8 clients 71 tokens/s (was 48-57).
        sharing = Counter(st.node.name for st in self.plan.stages)
        self.pipelines: list[_Pipeline] = []
        for r in range(pipelines):
            actors = []
            for st in self.plan.stages:
                share = max(1, st.node.cpus // (sharing[st.node.name] * pipelines))
                spec = StageSpec(str(path), st.start, st.end, st.index, n, wire_dtype,
                                 n_ctx=n_ctx, chunk=self.cache.chunk,
                                 threads=threads or share, lane_batch=lane_batch,
                                 weight_format=weight_format)
                here = ""
                if is_package(path):
                    n_here = sum(i in st.node.layers for i in range(st.start, st.end))
                    here = f", parts of {n_here}/{st.n_layers} layers already there"
                progress(f"pipeline {r} stage {st.index}: layers {st.start}-{st.end - 1} on "
                         f"node {st.node.name[:12]}, {st.total_bytes / 2**20:.0f} MiB{here}")
                burst = None if threads else share * sharing[st.node.name]
                actors.append(StageActor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(st.node.name, soft=False),
                    num_cpus=0, max_restarts=RESTARTS, max_task_retries=-1,
                    runtime_env={"env_vars": stage_env()},
                ).remote(spec, self.cache, policy, runtime, burst_threads=burst))
            self.pipelines.append(_Pipeline(actors))
        t = time.monotonic()
        for pipe in self.pipelines:
            pipe.wire()
        progress(f"loaded in {time.monotonic() - t:.1f} s")
        self.router = Router(pipelines, self.cache.stride)
        self.info = EngineInfo(model=model_name or path.stem, path=str(path), n_ctx=n_ctx,
                               n_stages=n, topology_digest=self.plan.digest,
                               extra={"runtime": runtime, "policy": policy,
                                      "pipelines": pipelines, "weight_format": weight_format,
                                      "lane_batch": lane_batch})

    @property
    def actors(self) -> list:
        """The first pipeline's stage actors (tests and tools)."""
        return self.pipelines[0].actors

    def node_ids(self, pipeline: int = 0) -> list[str]:
        return ray.get([a.node_id.remote() for a in self.pipelines[pipeline].actors],
                       timeout=60)

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        check_fits(request, self.info.n_ctx)
        p = self.router.choose(request.tokens, request.namespace)
        pipe = self.pipelines[p]
        produced: list[int] = []
        failures = 0
        try:
            while True:
                try:
                    async for step in self._run(pipe, request, produced):
                        produced.append(step.token)
                        yield step
                    return
                except (grpc.aio.AioRpcError, _Retry) as e:
                    failures += 1
                    if failures > REBUILD_ATTEMPTS:
                        raise EngineError(f"the pipeline failed {failures} times: {e}") from e
                    log.warning("pipeline %d failed (%s); rebuilding the request after %d "
                                "tokens", p, e, len(produced))
                    await asyncio.to_thread(pipe.wire)
        finally:
            self.router.finished(p)

    async def _run(self, pipe: _Pipeline, request: GenerationRequest,
                   produced: list[int]) -> AsyncIterator[Step]:
        """One attempt: prefill prompt + the tokens already produced, then decode."""
        tokens = list(request.tokens) + produced
        call = pipe.stub().Session()
        try:
            limit = len(tokens) - 1  # the last row is always computed
            reply = None
            for _ in range(2):  # a restore that fails after planning: plan again from 0
                await call.write(pb.StageCall(plan=pb.Plan(
                    tokens=tokens, limit=limit, probe=request.probe,
                    namespace=request.namespace)))
                start = (await _read(call)).plan.start
                sampling = sampling_to_proto(request.sampling, produced)
                await call.write(pb.StageCall(prefill=pb.Prefill(
                    tokens=tokens, start=start, sampling=sampling, probe=request.probe,
                    namespace=request.namespace, max_tokens=request.max_tokens)))
                try:
                    reply = await _read(call)
                    break
                except _Retry:
                    limit = 0
            if reply is None:
                raise _Retry("the prefill failed twice")
            token, cached = reply.token, reply.token.cached_tokens
            remaining = request.max_tokens - len(produced)
            for i in range(remaining):
                if token.id in request.stop_ids:
                    return
                yield Step(token.id, cached if not produced and i == 0 else 0,
                           token_logprobs(token))
                if i + 1 == remaining:
                    return
                await call.write(pb.StageCall(decode=pb.Decode(token=token.id)))
                token = (await _read(call)).token
        finally:
            call.cancel()

    # -- figures and lifetime ----------------------------------------------------------------
    def stats(self) -> dict:
        """Per-stage figures, summed over pipelines stage by stage."""
        try:
            per = [ray.get([a.stats.remote() for a in pipe.actors], timeout=10)
                   for pipe in self.pipelines]
        except Exception as e:  # a stage restarting: figures are best effort
            log.warning("stage figures unavailable: %s", e)
            return {"stages": []}
        return {"stages": per[0] if len(per) == 1 else [_sum(col) for col in zip(*per)],
                "in_flight": list(self.router.load)}

    def status(self) -> dict:
        return {"serving": True, "detail": f"{len(self.pipelines)} pipeline(s)"}

    async def close(self) -> None:
        for pipe in self.pipelines:
            await pipe.close()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _sum(dicts: list[dict]) -> dict:
    """Numbers added key by key (nested dicts too); anything else from the first."""
    out = dict(dicts[0])
    for d in dicts[1:]:
        for k, v in d.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = _sum([out[k], v])
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and k in out:
                out[k] = out[k] + v
    return out


class _Retry(Exception):
    """A stage asked for the request to be rebuilt."""


async def _read(call) -> pb.StageResult:
    reply = await call.read()
    if reply is grpc.aio.EOF:
        raise _Retry("the stage closed the stream")
    kind = reply.WhichOneof("result")
    if kind == "error":
        if reply.error.busy:
            raise EngineBusy(reply.error.message)
        if reply.error.retryable:
            raise _Retry(reply.error.message)
        raise EngineError(reply.error.message)
    return reply
