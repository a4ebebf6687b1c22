"""The mesh engine: stage actors placed by Ray, requests driven over gRPC.

Ray is the control plane: it places one `StageActor` per planned stage (pinned to the
planned node), restarts dead ones and carries figures back. The router pins a request to
a pipeline for its whole life; the driver (mesh/control/driver.py) runs it through the
pipeline's stage 0 over a gRPC stream.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from skippy.cache.config import CacheConfig, format_bytes
from skippy.stages.runtime import StageSpec
from skippy.stages.runtime_kind import REFERENCE_FORMAT, TORCH, RuntimeKind
from skippy.topology.errors import UserError
from skippy.topology.model_package import is_package
from skippy.topology.planner import DEFAULT_LANES, DEFAULT_N_CTX, NodeSpec, Plan, StagePlan

from .. import tracing
from ..progress import progress_bar
from ..stage.channels import HOP_DELAY_ENV, HOST_DELAY_ENV
from ..stage.grpc_service import message_limit
from ..stage.security import TLS_MODES, ClusterCredentials, new_secret, tls_wanted
from . import autoscaler_ask
from .link_probe import with_links
from .part_sources import PartSources
from .pipelines import PipelinesEngine, node_figures
from .ray_pipeline import ACTOR_START_TIMEOUT, RayPipeline, Recut
from .scaling import Scaler, ScalingPolicy
from .served_model import ServedModel
from .speculation import StepCosts

log = logging.getLogger(__name__)

RESTARTS = 3  # Ray restarts a stage actor this many times; then the engine re-creates it
# OpenMP's idle workers spin this many times before they sleep (libgomp's default is
# about 300,000): a bursting stage's idle workers otherwise spin through the next stage's
# step on the same cores (evals/README.md, "two stages on one node").
GOMP_SPINCOUNT = "10000"


LOOPBACK = "127.0.0.1"
# Ray gives its raylet a fixed 30 s to register; on a loaded 2-core machine a start has
# missed it (a raylet that never wrote a log). A start that misses it is tried once more.
NODE_LATE = "timed out during startup"


def start_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join `address`, or start a light embedded Ray (DESIGN.md §9) that listens on
    loopback only. True if we started it."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    # address="local": always a new embedded Ray. Without it ray.init joins whatever
    # cluster /tmp/ray/ray_current_cluster names, even one whose processes were killed.
    try:
        _start_local(num_cpus)
    except Exception as e:  # Ray raises a bare Exception when its raylet is late
        if NODE_LATE not in str(e):
            raise
        ray.shutdown()  # what did start goes; the second start is a new node
        _start_local(num_cpus)
    return True


def _start_local(num_cpus: int | None) -> None:
    embedded_token()
    with _loopback_node():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2,
                 include_dashboard=False,
                 object_store_memory=100 * 2**20, log_to_driver=False,
                 _node_ip_address=LOOPBACK)


def embedded_token() -> Path | None:
    """Token authentication for an embedded Ray, with a token of this serve's own in a
    file only this user reads (removed at exit), unless the environment chose a mode
    (RAY_AUTH_MODE). Ray's own default for a new local Ray writes ~/.ray/auth_token under
    the umask (0644 by default), shared by every Ray of the user and readable by others:
    whoever holds the token can attach and run code as us. The file's path, or None."""
    if "RAY_AUTH_MODE" in os.environ:
        return None
    folder = Path(tempfile.mkdtemp(prefix="skippy-ray-auth-"))  # 0700
    path = folder / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    atexit.register(shutil.rmtree, folder, True)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ["RAY_AUTH_MODE"] = "token"  # for this process, and the ones Ray starts
    from ray._raylet import AuthenticationTokenLoader, Config
    Config.initialize("")  # Ray read its settings at import: again, with token mode
    AuthenticationTokenLoader.instance().reset_cache()
    return path


@contextlib.contextmanager
def _loopback_node():
    """Ray's servers (GCS, raylet, workers, the autoscaler's metrics) bind 127.0.0.1 only
    when the node's address is 127.0.0.1, and `ray.init` turns a loopback address into
    the host's primary one unless clusters are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    its macOS default). That switch, for the start only (tests/test_stage_network.py
    lists what binds where)."""
    from ray._private import ray_constants
    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


def stage_env() -> dict[str, str]:
    """Environment of the stage actors; a user's own OpenMP wait settings win, and the
    latency test hooks go with them where they are set."""
    env = {} if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ else \
        {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    for hook in (HOP_DELAY_ENV, HOST_DELAY_ENV):
        if os.environ.get(hook):
            env[hook] = os.environ[hook]
    return env


@ray.remote(num_cpus=0)
def _layers_here(package: str, model_digest: str) -> list[int]:
    # at the head's path or in this node's own package folder (fetched or pre-seeded)
    from skippy.mesh.stage.part_store import layers_held
    return sorted(layers_held(package, model_digest))


@ray.remote(num_cpus=0)
def _file_here(path: str, size: int) -> bool:
    p = Path(path)
    return p.is_file() and p.stat().st_size == size


# a restore's wait for the requests in flight: those waiting for lanes meanwhile wait
# their bounded time (admission.QUEUE_WAIT_S) for this and the new stages' load together
RESTORE_WAIT_S = 10.0


def cluster_nodes(model: Path | None = None, model_digest: str = "", *,
                  links: bool = False) -> list[NodeSpec]:
    """The alive Ray nodes as planner nodes; the name is the Ray node id. Serving a
    package, each node also says which layers' parts it holds at the same path, so the
    planner can put stages where their parts are; serving a GGUF file, nodes without it at
    the same path (and size) are left out, and said so in the log. `links`: with the
    links between them measured (link_probe.py), for a plan."""
    out, alive = [], [n for n in ray.nodes() if n.get("Alive")]
    for n in alive:
        res = dict(n.get("Resources", {}))
        out.append(NodeSpec(name=n["NodeID"], memory=int(res.pop("memory", 0)),
                            cpus=int(res.pop("CPU", 1)),
                            resources={k: v for k, v in res.items()
                                       if not k.startswith(("node:", "object_store"))}))
    if links:
        out = with_links(out, alive)
    if model is None:
        return out
    package = is_package(model)
    ask = _layers_here if package else _file_here
    arg = model_digest if package else model.stat().st_size
    held = ray.get([ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node.name, soft=False)).remote(str(model), arg) for node in out], timeout=60)
    if package:
        return [dataclasses.replace(node, layers=frozenset(layers))
                for node, layers in zip(out, held)]
    for node, here in zip(out, held):
        if not here:
            log.warning("node %s has no %s: no stage is placed there", node.name[:12], model)
    return [node for node, here in zip(out, held) if here]


def plan_model(model_path: str | Path, runtime: RuntimeKind, n_stages: int | None, *,
               pipelines: int, lanes: int, ranges: list[tuple[int, int]] | None = None,
               wire_dtype: str = "f16", n_ctx: int = DEFAULT_N_CTX,
               weight_format: str = REFERENCE_FORMAT,
               reserved: Counter | None = None, cache: CacheConfig | None = None
               ) -> ServedModel:
    """The model planned onto the alive nodes, less what `reserved` holds on each, as a
    RayEngine with these options serves it. Every pipeline uses the same plan: the same
    ranges compute the same numbers, so one topology digest names them all (the
    gateway's exact results rely on it)."""
    path = Path(model_path)
    return ServedModel.open(
        path, runtime, lambda digest: free_nodes(path, digest, reserved or Counter()),
        stages=n_stages, ranges=ranges, wire_dtype=wire_dtype, n_ctx=n_ctx,
        lanes=lanes * pipelines, weight_format=weight_format,
        cache_bytes=None if cache is None else cache.stage_bytes)


def planned_bytes(model: ServedModel, pipelines: int) -> int:
    """What a RayEngine serving `model` holds: each stage's plan, once per pipeline."""
    return pipelines * sum(st.total_bytes for st in model.plan.stages)


def free_nodes(model: Path, model_digest: str, reserved: Counter) -> list[NodeSpec]:
    """`cluster_nodes`, less the bytes `reserved` on each (other models' stages)."""
    return [dataclasses.replace(n, memory=max(0, n.memory - reserved.get(n.name, 0)))
            for n in cluster_nodes(model, model_digest, links=True)]


@dataclasses.dataclass
class _Launch:
    """How to start each stage's actor: what a re-created actor needs again."""
    model: ServedModel
    cache: CacheConfig
    pipelines: int
    restarts: int
    threads: int | None  # None: the cores of the node, shared by its stages
    lane_batch: int
    credentials: ClusterCredentials  # issues each actor its own
    host: str | None  # where stage servers listen (None: Ray's address of their node)
    parts: PartSources | None = None  # serving a package: where stages get their parts
    # bytes other models' stages hold on each node (a gateway serving several)
    reserved: Callable[[], Counter] = Counter
    # nodes being drained: no stage is placed there any more
    excluded: set[str] = dataclasses.field(default_factory=set)
    # (pipeline, stage) -> the node its actor was put on
    placed: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    # names the turns that stages sharing a node's cores take (pipeline r's: "<turns>-r")
    turns: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))

    @property
    def path(self) -> Path:
        return self.model.path

    @property
    def plan(self) -> Plan:
        return self.model.plan

    def node_for(self, r: int, i: int) -> str:
        """Where pipeline r's stage i goes: the node it is on while that is alive. The
        first pipeline starts where the plan put it; the others on the alive nodes with
        the most memory left that hold them, so pipelines spread over the cluster (and
        share the plan's node when nothing else has room). A lost node's stages move,
        with the same layer ranges, to such a node: the split and its topology digest
        stay, so state and answers stay exact."""
        st = self.plan.stages[i]
        current = self.placed.get((r, i), st.node.name if r == 0 else None)
        if current is not None and any(n["NodeID"] == current and n.get("Alive")
                                       for n in ray.nodes()):
            self.placed[(r, i)] = current
            return current
        node = self._roomiest(r, i)
        if node is None:
            if current is not None:
                fresh = self._replanned(r)
                if fresh is not None:  # RayPipeline makes every stage of the new plan
                    log.warning("pipeline %d stage %d lost node %s and no alive node can "
                                "hold layers %d-%d whole: the model is cut anew", r, i,
                                current[:12], st.start, st.end - 1)
                    raise Recut(fresh)
                log.error("pipeline %d stage %d lost node %s and no alive node can hold "
                          "layers %d-%d, nor the model cut anew; it waits for that node",
                          r, i, current[:12], st.start, st.end - 1)
                return current
            node = st.node.name
        elif current is not None:
            log.warning("pipeline %d stage %d: node %s is lost; layers %d-%d move to node "
                        "%s (same split, topology %s)", r, i, current[:12], st.start,
                        st.end - 1, node[:12], self.plan.digest[:16])
        self.placed[(r, i)] = node
        return node

    def _replanned(self, r: int) -> ServedModel | None:
        """The model planned anew over the alive nodes (the fewest stages that fit: other
        ranges, another topology), where pipeline r is the only one placed; None where
        there are others (they serve on) or it fits nowhere."""
        if {q for q, _ in self.placed} != {r}:
            return None
        m = self.model
        try:
            return plan_model(m.path, m.runtime, None, pipelines=1, lanes=m.plan.lanes,
                              wire_dtype=m.plan.wire_dtype, n_ctx=m.plan.n_ctx,
                              weight_format=m.weight_format, reserved=self.reserved(),
                              cache=self.cache)
        except UserError as e:
            log.error("the model fits nowhere cut anew: %s", e)
            return None

    def room_for(self, r: int) -> bool:
        """Places a new pipeline r's stages where each has room (a node that joined
        included); False, placing nothing, where one has none."""
        for i in range(len(self.plan.stages)):
            node = self._roomiest(r, i)
            if node is None:
                self.forget(r)
                return False
            self.placed[(r, i)] = node
        return True

    def forget(self, r: int) -> None:
        """Pipeline r's stages are gone: their memory is free for later placements."""
        for key in [k for k in self.placed if k[0] == r]:
            del self.placed[key]

    def placement(self, r: int) -> str:
        return f"pipeline {r}: " + ", ".join(
            f"stage {i} on node {self.placed[(r, i)][:12]}"
            for i in range(len(self.plan.stages)))

    def _roomiest(self, r: int, i: int) -> str | None:
        """The alive node with the most memory left that can hold pipeline r's stage i
        (serving a package: holding its parts); None if none can."""
        st = self.plan.stages[i]
        held = Counter(self.reserved())
        for (q, j), node in self.placed.items():
            if (q, j) != (r, i):
                held[node] += self.plan.stages[j].total_bytes
        fits = [n for n in cluster_nodes(self.path, self.plan.model_digest)
                if n.name not in self.excluded and n.memory - held[n.name] >= st.total_bytes
                and (not is_package(self.path) or set(range(st.start, st.end)) <= n.layers)]
        if not fits:
            return None
        return max(fits, key=lambda n: n.memory - held[n.name]).name

    def spec(self, st: StagePlan) -> tuple[StageSpec, int | None]:
        """The stage's spec and its burst threads. Stages sharing a node share its cores
        (they all compute at once under concurrent requests); one session alone keeps
        them computing in turn, so each may then take its pipeline's cores there."""
        sharing = Counter(s.node.name for s in self.plan.stages)[st.node.name]
        share = max(1, st.node.cpus // (sharing * self.pipelines))
        spec = self.model.spec(st.index, chunk=self.cache.chunk,
                               threads=self.threads or share, lane_batch=self.lane_batch)
        return spec, None if self.threads else share * sharing

    def parts_for(self, spec: StageSpec):
        """Serving a package: the stage's parts and where to fetch those its node lacks."""
        if not is_package(self.path):
            return None
        if self.parts is None:
            self.parts = PartSources(self.path, self.credentials, self.host,
                                     lambda: cluster_nodes(self.path, self.plan.model_digest))
        return self.parts.for_stage(spec)

    def actor(self, r: int, i: int):
        from ..stage.actor import StageActor
        st = self.plan.stages[i]
        spec, burst = self.spec(st)
        return StageActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_for(r, i),
                                                               soft=False),
            num_cpus=0, max_restarts=self.restarts, max_task_retries=-1,
            runtime_env={"env_vars": stage_env()},
        ).remote(spec, self.cache.within(st.cache_bytes), self.model.policy,
                  self.model.runtime, self.host, burst,
                  credentials=self.credentials.issue(), parts=self.parts_for(spec),
                  traces=tracing.exporting_to(),  # stages trace where the driver does
                  turn=f"{self.turns}-{r}" if burst and burst > spec.threads else None)


def _new_pipeline(launch: _Launch, n_stages: int, credentials, max_message: int,
                  recut: Callable, r: int) -> RayPipeline:
    """Pipeline r's stage actors, placed (not yet loaded: `_load`); `recut(r, model)`: the
    engine takes a new plan for it (RayPipeline's)."""
    return RayPipeline(functools.partial(launch.actor, r), n_stages, credentials=credentials,
                       max_message=max_message, recut=functools.partial(recut, r))


class RayEngine(PipelinesEngine):
    def __init__(self, model_path: str | Path, n_stages: int | None = None, *,
                 pipelines: int = 1, model_name: str | None = None,
                 address: str | None = None, cache: CacheConfig | None = None,
                 runtime: RuntimeKind = TORCH, wire_dtype: str = "f16",
                 n_ctx: int = DEFAULT_N_CTX, threads: int | None = None,
                 weight_format: str = REFERENCE_FORMAT, lane_batch: int = 1,
                 lanes: int = DEFAULT_LANES, ranges: list[tuple[int, int]] | None = None,
                 restarts: int = RESTARTS, secret: str | None = None,
                 stage_tls: str = "auto", progress: Callable[[str], None] = log.info,
                 reserved: Callable[[], Counter] = Counter, speculate: bool = True,
                 draft: str | Path | None = None, scaling: ScalingPolicy | None = None):
        """`secret`: what every stage call must carry (default: a new random one);
        `stage_tls`: auto (on when the cluster has more than one node), on, off;
        `reserved`: the bytes other models hold on each node (by node id), which this
        one's plan and placements leave free; `speculate`: decode steps verify proposed
        tokens where every stage can (the same text, fewer trips through the stages);
        `draft`: a draft model's GGUF, run in this process, proposes them; `scaling`:
        pipelines added while requests wait for lanes, released when idle (scaling.py).
        """
        _check_options(pipelines, stage_tls)
        self._owns_ray = start_ray(address)
        self.cache = cache or CacheConfig()
        self.model = plan_model(model_path, runtime, n_stages, pipelines=pipelines,
                                lanes=lanes, ranges=ranges, wire_dtype=wire_dtype,
                                n_ctx=n_ctx, weight_format=weight_format,
                                reserved=reserved(), cache=self.cache)
        self.plan, path, n = self.model.plan, self.model.path, len(self.model.plan.stages)
        progress(f"plan: {n} stage(s) x {pipelines} pipeline(s), {lanes} lanes each, "
                 f"topology {self.plan.digest[:16]}")
        if self.plan.link_ms is not None:  # the nodes' links weighed in (link_probe.py)
            progress(f"links: about {self.plan.link_ms:.0f} ms a token on the network")
        # Decided for every placement to come, not by the nodes there are now: a node
        # that joins later may get a stage (a lost one's), and its traffic leaves the host.
        self.stage_tls, host = stage_network(stage_tls, ray.get_runtime_context().gcs_address)
        cluster = ClusterCredentials(secret or new_secret(), self.stage_tls)
        progress(_caches_line(self.cache))
        progress(f"stage network: {'mutual TLS' if self.stage_tls else 'plain TCP'} on "
                 f"{host or 'each node address'}, calls carry the cluster secret")
        self._launch = _Launch(self.model, self.cache, pipelines, restarts, threads,
                               lane_batch, cluster, host, reserved=reserved)
        for st in self.plan.stages:
            progress(_placement(st, path))
        self._new_pipeline = functools.partial(
            _new_pipeline, self._launch, n, cluster.issue(),
            message_limit(str(path), self.plan.n_ctx, wire_dtype), self._cut_anew)
        self.pipelines = [self._new_pipeline(r) for r in range(pipelines)]
        for r in range(1, pipelines):
            progress(self._launch.placement(r))
        _load(self.pipelines, self.plan, progress)
        for i, how in enumerate(ray.get([a.compute.remote() for a in self.actors], timeout=60)):
            progress(f"stage {i} computes with {how}")
        self._serve(self.pipelines, lanes, self.cache.stride, speculate,
                    None if draft is None else Path(draft))
        self.info = self.model.info(model_name, lanes, pipelines=pipelines,
                                    weight_format=weight_format, lane_batch=lane_batch)
        self._lanes, self._progress = lanes, progress
        self._asked = (n_stages, ranges)  # the plan a loss's re-cut returns to (restore)
        self._cut_by_loss = False
        self.scaler = None if scaling is None else Scaler(self, scaling, progress)
        self.ask_for_room()

    # -- capacity that follows load (scaling.py) -----------------------------------------
    async def reserve(self, lanes: int):
        if self.scaler is not None:
            self.scaler.start()
        return await super().reserve(lanes)

    async def generate(self, request):
        if self.scaler is not None:
            self.scaler.start()
        async for step in super().generate(request):
            yield step

    async def grow(self) -> int | None:
        """One pipeline more, where every stage of a whole copy has room (None: none);
        its index once it serves."""
        return await asyncio.to_thread(self._grow)

    def _grow(self) -> int | None:
        # joined here, not by the caller: a pipeline that loaded serves even where the
        # caller was cancelled meanwhile
        r = len(self.pipelines)
        if not self._launch.room_for(r):
            return None
        pipe = self._new_pipeline(r)
        self._progress(self._launch.placement(r))
        _load([pipe], self.plan, self._progress)
        added = self._add_pipeline(pipe, self._lanes)
        self.ask_for_room()
        return added

    def ask_for_room(self, more: int = 0) -> list[dict]:
        """Ray's autoscaler, where one runs, keeps room for this model's live pipelines'
        stages and `more` whole copies (autoscaler_ask.py): the cluster's request."""
        copies = len(self.live()) + more
        return autoscaler_ask.ask(self, [{"memory": float(st.total_bytes)}
                                         for _ in range(copies) for st in self.plan.stages])

    async def restore(self, wait_s: float = RESTORE_WAIT_S) -> bool:
        """After a loss cut the model anew, a node joined: where the plan asked for at
        start fits the alive nodes again, the only pipeline goes back to it. New
        requests wait for lanes meanwhile and those in flight end first (up to wait_s;
        any left are rebuilt on the new cut, as after a fault). False: nothing to do."""
        if not self._cut_by_loss or len(self.live()) != 1:
            return False
        model = await asyncio.to_thread(self._asked_plan)
        if model is None:
            return False
        r = self.live()[0]
        self._progress(f"pipeline {r}: the plan asked for fits again ({len(model.plan.stages)} "
                       f"stage(s)): new requests wait while the {self.router.load[r]} in "
                       f"flight end, then the model is cut as asked")
        self.admission.pause(True)
        try:
            deadline = time.monotonic() + wait_s
            while self.router.load[r] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.pipelines[r].cut_to, model)
        finally:
            self.admission.pause(False)
        self._cut_by_loss = False
        return True

    def _asked_plan(self) -> ServedModel | None:
        """The plan asked for at start, over the alive nodes, where it fits and differs
        from the one served."""
        m, (n_stages, ranges) = self.model, self._asked
        try:
            fresh = plan_model(m.path, m.runtime, n_stages, pipelines=1, lanes=self._lanes,
                               ranges=ranges, wire_dtype=m.plan.wire_dtype,
                               n_ctx=m.plan.n_ctx, weight_format=m.weight_format,
                               reserved=self._launch.reserved(), cache=self.cache)
        except UserError:
            return None  # not yet: the model stays as it is cut
        return fresh if fresh.plan.digest != self.plan.digest else None

    def _cut_anew(self, r: int, model: ServedModel) -> tuple[Callable[[int], object], int]:
        """Pipeline r, the only one, serves `model`'s new plan (a lost node's layers fit
        whole nowhere): the engine's plan from now on, and how to make its stages. Its
        requests are rebuilt there, and answers keyed by the old topology no longer match."""
        was = self.plan.digest
        self._cut_by_loss = True  # until restore() returns it to the plan asked for
        self.model, self.plan = model, model.plan
        self._launch.model = model
        self._launch.forget(r)
        self._launch.parts = None  # part servers anew, on alive holders
        self.step_costs[r] = StepCosts()
        n = len(self.plan.stages)
        self.info = dataclasses.replace(self.info, n_stages=n, topology_digest=self.plan.digest)
        self._new_pipeline = functools.partial(self._new_pipeline.func, self._launch, n,
                                               *self._new_pipeline.args[2:])
        self._progress(f"pipeline {r}: cut anew over the alive nodes: {n} stage(s), "
                       f"topology {self.plan.digest[:16]} (was {was[:16]})")
        for st in self.plan.stages:
            self._progress(_placement(st, model.path))
        self.ask_for_room()  # the new plan's stages
        return functools.partial(self._launch.actor, r), n

    async def drain(self, node: str, wait_s: float = 600.0) -> dict:
        """Every stage off `node` (a Ray node id, or its first characters): each pipeline
        with a stage there is replaced by a copy placed on other nodes, then retired (its
        requests in flight end there, waiting up to wait_s); no stage is placed there
        again. UserError for a node this engine does not know or where no other node has
        room (then nothing moved)."""
        nid = self._node_named(node)
        self._launch.excluded.add(nid)
        moved = []
        for r in self.live():
            if nid not in (self._launch.placed.get((r, i)) for i in range(len(self.plan.stages))):
                continue
            new = await self.grow()
            if new is None:
                self._launch.excluded.discard(nid)
                raise UserError(f"no other node has room for pipeline {r}'s stages: node "
                                f"{nid[:12]} keeps them")
            self._progress(f"draining node {nid[:12]}: pipeline {r} moves to pipeline {new} "
                           f"({self._launch.placement(new)})")
            await self.shrink(r, wait_s)
            moved.append({"from": r, "to": new})
        return {"node": nid, "moved": moved,
                "held": [r for r in self.live() for i in range(len(self.plan.stages))
                         if self._launch.placed.get((r, i)) == nid]}

    def _node_named(self, node: str) -> str:
        ids = {n["NodeID"] for n in ray.nodes()} | set(self._launch.placed.values())
        found = [i for i in ids if i.startswith(node)] if node else []
        if len(found) != 1:
            raise UserError(f"node {node!r} names {len(found)} of the cluster's nodes "
                            f"(give more of its id)" if found else
                            f"no node of the cluster is named {node!r}")
        return found[0]

    def nodes(self) -> int:
        """The cluster's alive nodes (a blocking call to Ray's GCS)."""
        return sum(1 for n in ray.nodes() if n.get("Alive"))

    async def shrink(self, p: int, wait_s: float = 60.0) -> None:
        """Pipeline p takes no new request, ends those it has (waiting up to wait_s),
        then its stages go."""
        self._retire_pipeline(p, self._lanes)
        deadline = time.monotonic() + wait_s
        while self.router.load[p] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.pipelines[p].close()
        self._launch.forget(p)
        await asyncio.to_thread(self.ask_for_room)

    def held_bytes(self) -> Counter:
        """The bytes the plan holds on each node (by node id): every pipeline's stages
        where they run now."""
        held = Counter()
        for (_, i), node in self._launch.placed.items():
            held[node] += self.plan.stages[i].total_bytes
        return held

    @property
    def actors(self) -> list:
        """The first pipeline's stage actors (tests and tools)."""
        return self.pipelines[0].actors

    def node_ids(self, pipeline: int = 0) -> list[str]:
        return ray.get([a.node_id.remote() for a in self.pipelines[pipeline].actors],
                       timeout=60)

    def pipeline_stats(self, pipeline: int) -> list[dict]:
        """One pipeline's stage figures."""
        return ray.get([a.stats.remote() for a in self.pipelines[pipeline].actors],
                       timeout=60)

    def stats(self) -> dict:
        """Per-stage figures, summed over pipelines stage by stage."""
        live = self.live()
        try:
            per = [ray.get([a.stats.remote() for a in self.pipelines[r].actors], timeout=10)
                   for r in live]
        except Exception as e:  # a stage restarting: figures are best effort
            log.warning("stage figures unavailable: %s", e)
            per = [[]]
        stages = per[0] if len(per) == 1 else [_sum(col) for col in zip(*per)]
        scaling = {} if self.scaler is None else {
            "scaling": {"pipelines": len(live), "added": self.scaler.added,
                        "released": self.scaler.released}}
        return {"stages": self._with_free_lanes(stages),
                "recreated": sum(p.recreated for p in self.pipelines),
                "nodes": self._by_node(live, per), "plan": self._plan_figures(live),
                **scaling, **self._figures()}

    def _plan_figures(self, live: list[int]) -> dict:
        """The plan's stages where they run now (a lost node's stages move)."""
        return self.model.figures(live, lambda r, i: self._launch.placed.get(
            (r, i), self.plan.stages[i].node.name))

    def _by_node(self, live: list[int], per: list[list[dict]]) -> dict[str, dict]:
        return node_figures((self._launch.placed.get((r, i), "")[:12], s)
                            for r, stages in zip(live, per) for i, s in enumerate(stages))

    async def close(self) -> None:
        if self.scaler is not None:
            await self.scaler.close()
        for r in self.live():
            await self.pipelines[r].close()
        autoscaler_ask.ask(self, [])
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def stage_network(mode: str, gcs_address: str) -> tuple[bool, str | None]:
    """(TLS on, where stage servers listen: None for each node's own address) for a
    cluster whose GCS is at `gcs_address`. One whose GCS listens on loopback (the
    embedded Ray) is this host alone for good: stages stay on loopback, in the clear
    unless `mode` is "on". Any other can gain hosts at any time."""
    host = gcs_address.rsplit(":", 1)[0].strip("[]")
    try:
        alone = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: another host may be behind it
        alone = False
    return tls_wanted(mode, can_grow=not alone), LOOPBACK if alone else None


def _check_options(pipelines: int, stage_tls: str) -> None:
    if pipelines < 1:
        raise ValueError(f"pipelines must be at least 1, not {pipelines}")
    if stage_tls not in TLS_MODES:
        raise ValueError(f"stage_tls must be one of {', '.join(TLS_MODES)}, not "
                         f"{stage_tls!r}")


def _caches_line(c: CacheConfig) -> str:
    if not c.enabled:
        return "caches: off"
    disk = f"disk tier {format_bytes(c.cold_max_bytes)}" if c.cold_max_bytes \
        else "no disk tier"
    return (f"caches per stage: RAM {format_bytes(c.max_bytes)}, {disk}; state blocks kept "
            f"once per node")


def _load(pipelines: list[RayPipeline], plan: Plan, say: Callable[[str], None]) -> None:
    """Wait for every stage actor to load its weights, saying each as it comes up (stages
    of N, weight bytes: a bar on a terminal), then wire each pipeline's chain."""
    t = time.monotonic()
    loading = {a.address.remote(): plan.stages[i].weight_bytes
               for pipe in pipelines for i, a in enumerate(pipe.actors)}
    n = len(loading)
    with progress_bar(sum(loading.values()), f"loading {n} stage(s)", "B", say=say) as bar:
        while loading:
            # one that failed is "ready" too: wire() below re-creates it, or raises
            ready, _ = ray.wait(list(loading), num_returns=1,
                                timeout=max(0.0, t + ACTOR_START_TIMEOUT - time.monotonic()))
            if not ready:
                break  # wire() says which stage is late
            bar.note(f"{n - len(loading) + 1}/{n} stages")
            bar.update(loading.pop(ready[0]))
    for pipe in pipelines:
        pipe.wire()
    say(f"loaded in {time.monotonic() - t:.1f} s")


def _placement(st: StagePlan, path: Path) -> str:
    here = ""
    if is_package(path):
        n_here = sum(i in st.node.layers for i in range(st.start, st.end))
        here = f", parts of {n_here}/{st.n_layers} layers already there"
    return (f"stage {st.index}: layers {st.start}-{st.end - 1} on node "
            f"{st.node.name[:12]}, {st.total_bytes / 2**20:.0f} MiB{here}")


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
