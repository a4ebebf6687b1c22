"""Cutting a model's layers into contiguous stages and placing them on nodes.

`plan()` maps a model (`ModelFacts`, read from a GGUF's header and tensor index, never its
tensor bytes) onto nodes (`NodeSpec`): the fewest stages that fit, layer ranges in
proportion to each node's memory, every stage's weights + KV + overhead within its node,
and no cut inside a group the family keeps together. Nodes that already hold some layers'
package parts get the stages holding most of those layers (the cut stays as memory
sets it). The plan's digest names the split (model, ranges, wire dtype) and nothing
about where it runs, so caches keyed by it survive restarts and re-placement.

On one node memory cannot weigh stages against each other: there the stages are the
plain equal split (`even_ranges()`), the same wherever the plan is made. A caller that has
chosen its own split passes its ranges; the plan then sizes and places those.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from skippy.cache.config import ConfigError, parse_bytes

from .errors import UserError
from . import links as link_costs
from .gguf_file import GGUFFile
from .links import Link
from .model_config import ModelConfig
from .model_package import ModelPackage, open_model

MiB = 2**20

# Bytes per weight element in memory once a stage has loaded its layers, unless the caller
# says per tensor (stages/linear.py held_bytes, by weight format): fp32.
RUNTIME_WEIGHT_BYTES = 4.0
# Bytes per KV / recurrent-state element: lanes hold fp32 (stages/kv.py).
RUNTIME_KV_BYTES = 4
# Memory a stage needs beyond its weights and lanes: the actor process with torch loaded,
# activation buffers for a prefill chunk, allocator slack.
STAGE_OVERHEAD_BYTES = 512 * MiB

# The defaults of everything that plans, builds or serves stages: a request's context, and
# a pipeline's lane budget (requests it runs at once: 8 clients still decode together).
DEFAULT_N_CTX = 8192
DEFAULT_LANES = 8


class PlanError(UserError):
    """The model cannot be cut or placed as asked; the message says why."""


def even_ranges(n_layers: int, n_stages: int,
                keep_together: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """n_stages contiguous [start, end) ranges covering all layers, sizes within one of
    each other (earlier stages take the extra layers: stage 0 also embeds). With
    keep-together groups (ModelConfig.cut_groups), no cut falls inside one: the ranges
    are then as even as those cuts allow."""
    if n_stages < 1:
        raise PlanError(f"stages must be at least 1, not {n_stages}")
    if n_stages > n_layers:
        raise PlanError(f"cannot cut {n_layers} layers into {n_stages} stages "
                        "(each stage needs at least one layer)")
    groups = list(keep_together)
    if groups:
        allowed = [not any(a < c < b for a, b in groups) for c in range(n_layers + 1)]
        ranges = _split([1] * n_layers, [n_layers] * n_stages, allowed)
        if ranges is None:
            raise PlanError(f"cannot cut {n_layers} layers into {n_stages} stages without "
                            f"splitting a group the family keeps in one stage {groups}")
        return ranges
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# -- digests ----------------------------------------------------------------------------------
def gguf_model_digest(f: GGUFFile | ModelPackage) -> str:
    """BLAKE3 of a GGUF's header (all metadata and the tensor index) and of its small 1-D
    tensors (norms, biases). Cheap on any size of model: the large matrices are not read.
    It names the model for the topology digest; the cache identity carries, besides, the
    content hash of the bytes each stage actually loaded. A package's digest is the one
    its manifest recorded when it was split."""
    if isinstance(f, ModelPackage):
        return f.model_digest
    h = blake3.blake3()
    h.update(b"skippy-gguf-model-v1|")
    with open(f.path, "rb") as fh:
        h.update(fh.read(f.data_start))
    for info in sorted(f.tensors.values(), key=lambda t: t.name):
        if len(info.shape) == 1:
            h.update(f"|{info.name}|".encode())
            h.update(memoryview(f.raw(info.name)))
    return h.hexdigest()


def topology_digest(model_digest: str, ranges: Sequence[tuple[int, int]],
                    wire_dtype: str) -> str:
    """BLAKE3 hex of (model digest, ordered layer ranges, wire dtype): no node names or
    per-process values, so the same split has the same digest wherever it is placed."""
    text = "|".join(["skippy-topology-v1", model_digest, wire_dtype,
                     ",".join(f"{a}-{b}" for a, b in ranges)])
    return blake3.blake3(text.encode()).hexdigest()


# -- the model --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a model, in runtime bytes.

    Per layer: weight bytes, KV bytes per token per lane (0 for layers without attention),
    fixed recurrent-state bytes per lane. Outside the layers: bytes only stage 0 holds
    (token embeddings), bytes only the last stage holds (final norm, output head; a tied
    head is a second copy of the embeddings), bytes every stage holds (anything else).
    """

    name: str
    architecture: str
    model_digest: str
    layer_bytes: tuple[int, ...]
    kv_bytes_per_token: tuple[int, ...]
    state_bytes: tuple[int, ...]
    first_bytes: int
    last_bytes: int
    shared_bytes: int = 0
    context_length: int = DEFAULT_N_CTX
    keep_together: tuple[tuple[int, int], ...] = ()  # layer groups no cut may split
    hidden: int = 0  # a frame row's width (0: unknown)

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @classmethod
    def from_gguf(cls, path: str | Path, *, weight_bytes: float = RUNTIME_WEIGHT_BYTES,
                  tensor_bytes: Callable[[str, str, tuple[int, ...]], float] | None = None,
                  kv_bytes: int = RUNTIME_KV_BYTES,
                  model_digest: str | None = None) -> ModelFacts:
        """Facts from the header and tensor index only (of a GGUF, or of a package's
        manifest and shared part). `weight_bytes`: bytes per weight element in the
        runtime's weight format (fp32 torch: 4); `tensor_bytes(name, qtype name, shape)`,
        when given, says it per tensor instead. `model_digest`: pass the weights digest
        when the caller already has one; else `gguf_model_digest`."""
        f = open_model(path)
        try:
            cfg = ModelConfig.from_gguf(f)
            digest = model_digest or gguf_model_digest(f)
            elements = [0] * cfg.n_layers
            first = last = shared = 0
            def held(name: str, info) -> int:
                return int(info.n_elements * weight_bytes if tensor_bytes is None else
                           tensor_bytes(name, info.qtype.name, tuple(info.shape)))

            proposer = set(cfg.nextn_tensors(f.tensors))  # the last stage's (NextN)
            for name, info in f.tensors.items():
                size = held(name, info)
                if name in proposer:
                    last += size
                    if name != "token_embd.weight":
                        continue
                if name.startswith("blk."):
                    layer = int(name.split(".")[1])
                    if layer < cfg.n_layers:  # past it: prediction layers no stage loads
                        elements[layer] += size
                elif name == "token_embd.weight":
                    first += size
                    if cfg.tied_head:  # the last stage holds it as a head
                        last += held("output.weight", info)
                elif name in ("output.weight", cfg.family.output_norm):
                    last += size
                elif name in cfg.family.layer_sliced:  # each layer holds its columns
                    for i in range(cfg.n_layers):
                        elements[i] += size // cfg.n_layers
                else:  # rope tables and the like: every stage loads them
                    shared += size
        finally:
            f.close()
        kv, state = _lane_bytes(cfg, kv_bytes)
        return cls(name=Path(path).name, architecture=cfg.architecture, model_digest=digest,
                   layer_bytes=tuple(elements), kv_bytes_per_token=kv, state_bytes=state,
                   first_bytes=first, last_bytes=last, shared_bytes=shared,
                   context_length=cfg.context_length,
                   keep_together=cfg.cut_groups(), hidden=cfg.hidden)


def _lane_bytes(cfg: ModelConfig, kv_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer: KV bytes per token, and fixed recurrent-state bytes, of one lane."""
    kv, state = [], []
    for i in range(cfg.n_layers):
        fixed = 0
        if cfg.is_conv_layer(i):  # short conv: the last l_cache - 1 inputs
            kv.append(0)
            fixed += (cfg.conv_l_cache - 1) * cfg.hidden
        elif cfg.is_deltanet_layer(i):  # conv window over q, k, v; a state per value head
            kv.append(0)
            d = cfg.ssm_d_state
            conv_width = (2 * cfg.ssm_groups + cfg.ssm_heads) * d
            fixed += (cfg.ssm_d_conv - 1) * conv_width + cfg.ssm_heads * d * d
        else:  # 0 for a layer that reads another layer's KV (Gemma 4)
            kv.append(cfg.kv_values_per_token(i) * kv_bytes)
        if cfg.is_ssm_layer(i):  # Mamba2: conv window over x, B, C; SSM state per head
            conv_width = cfg.ssm_d_inner + 2 * cfg.ssm_groups * cfg.ssm_d_state
            fixed += (cfg.ssm_d_conv - 1) * conv_width + cfg.ssm_d_inner * cfg.ssm_d_state
        state.append(fixed * kv_bytes)
    return tuple(kv), tuple(state)


# -- nodes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeSpec:
    """A machine stages can be placed on. `memory`: bytes stages may use there;
    `resources`: Ray custom resources that pin an actor to it (e.g. {"skippy_node_0": 1});
    `layers`: the layers whose package parts are already on it; `latency_ms`: its link
    to the gateway, one way; `links`: its links to other nodes, by name (links.py)."""

    name: str
    memory: int
    cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    latency_ms: float | None = None
    layers: frozenset[int] = frozenset()
    links: Mapping[str, Link] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping) -> NodeSpec:
        """From a nodes-file entry; `memory` is bytes or a size string such as "8GiB"."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a node must be an object, not {d!r}")
        unknown = set(d) - {"name", "memory", "cpus", "resources", "latency_ms", "layers",
                            "links"}
        if unknown:
            raise PlanError(f"node {d.get('name', '?')}: unknown field(s) "
                            f"{', '.join(sorted(unknown))}")
        name, memory = d.get("name"), d.get("memory")
        if not isinstance(name, str) or not name:
            raise PlanError(f"every node needs a name: {dict(d)}")
        if isinstance(memory, str):
            try:
                memory = parse_bytes(f"node {name}: memory", memory)
            except ConfigError as e:
                raise PlanError(str(e)) from None
        if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
            raise PlanError(f"node {name}: memory must be a positive byte count or a size "
                            f"such as 8GiB, not {memory!r}")
        cpus = d.get("cpus", 1)
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
            raise PlanError(f"node {name}: cpus must be a positive whole number, not {cpus!r}")
        resources = d.get("resources") or {}
        if not isinstance(resources, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in resources.items()):
            raise PlanError(f"node {name}: resources must map names to numbers")
        latency = d.get("latency_ms")
        if latency is not None and (isinstance(latency, bool)
                                    or not isinstance(latency, (int, float)) or latency < 0):
            raise PlanError(f"node {name}: latency_ms must be a number >= 0, not {latency!r}")
        given = d.get("links") or {}
        if not isinstance(given, Mapping):
            raise PlanError(f"node {name}: links must map node names to links")
        return cls(name, memory, cpus, dict(resources), latency,
                   _layer_set(name, d.get("layers") or []),
                   {str(k): _link_from(name, str(k), v) for k, v in given.items()})


def _link_from(node: str, other: str, value) -> Link:
    """A nodes file's link: a latency in ms, or {latency_ms, bandwidth (bytes/s)}."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {"latency_ms": value}
    if not isinstance(value, Mapping) or set(value) - {"latency_ms", "bandwidth"}:
        raise PlanError(f"node {node}: the link to {other} must be a latency in ms or "
                        f"{{latency_ms, bandwidth}}, not {value!r}")
    latency, bandwidth = value.get("latency_ms", 0.0), value.get("bandwidth")
    for what, v, least in (("latency_ms", latency, 0), ("bandwidth", bandwidth, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or v < least):
            raise PlanError(f"node {node}: the link to {other}: {what} must be a number "
                            f">= {least}, not {v!r}")
    return Link(float(latency), None if bandwidth is None else float(bandwidth))


def _layer_set(node: str, items) -> frozenset[int]:
    """Layers from a nodes file: numbers and "a-b" ranges (inclusive)."""
    out: set[int] = set()
    for item in items if isinstance(items, list) else [items]:
        try:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                out.add(item)
                continue
            a, b = (int(x) for x in str(item).split("-"))
            if not 0 <= a <= b:
                raise ValueError
            out.update(range(a, b + 1))
        except ValueError:
            raise PlanError(f"node {node}: layers must be numbers or ranges such as "
                            f'"0-15", not {item!r}') from None
    return frozenset(out)


def load_nodes(path: str | Path) -> list[NodeSpec]:
    """A JSON nodes file: a list of {name, memory, cpus, resources, latency_ms, layers,
    links}."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"cannot read nodes file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"nodes file {path} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise PlanError(f"nodes file {path} must hold a non-empty JSON list of nodes")
    nodes = [NodeSpec.from_dict(d) for d in data]
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlanError(f"nodes file {path}: node names repeat")
    return nodes


def local_node(meminfo: str | Path = "/proc/meminfo") -> NodeSpec:
    """This machine as one node: MemAvailable, all CPUs."""
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    if available is None:
        raise PlanError(f"cannot read MemAvailable from {meminfo}; pass --nodes")
    return NodeSpec("local", available, os.cpu_count() or 1)


# -- the plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    index: int
    start: int                 # layers [start, end)
    end: int
    node: NodeSpec
    weight_bytes: int          # layers, plus embeddings (first) / head (last)
    kv_bytes: int              # KV for n_ctx tokens and recurrent state, all lanes
    overhead_bytes: int
    memory_share: int          # node memory this stage may use (all of it, unless shared)
    # what its caches (resident state, activation frames) may hold: the budget asked for,
    # or what the share leaves after the rest where that is less; None: not planned
    cache_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def n_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    model: str
    model_digest: str
    wire_dtype: str
    n_ctx: int                 # per lane, after capping at the model's context length
    lanes: int
    stages: tuple[StagePlan, ...]
    digest: str                # topology digest (see topology_digest)
    link_ms: float | None = None  # a token's time on the links, where they are known

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    def as_dict(self) -> dict:
        return {
            "model": self.model, "model_digest": self.model_digest,
            "topology_digest": self.digest, "wire_dtype": self.wire_dtype,
            "n_ctx": self.n_ctx, "lanes": self.lanes, "link_ms": self.link_ms,
            "stages": [{
                "index": s.index, "layers": [s.start, s.end], "node": s.node.name,
                "resources": dict(s.node.resources), "weight_bytes": s.weight_bytes,
                "kv_bytes": s.kv_bytes, "overhead_bytes": s.overhead_bytes,
                "total_bytes": s.total_bytes, "memory_share": s.memory_share,
                "cache_bytes": s.cache_bytes, "node_memory": s.node.memory,
            } for s in self.stages],
        }

    def table(self) -> str:
        caches = any(s.cache_bytes is not None for s in self.stages)
        rows = [("STAGE", "NODE", "LAYERS", "WEIGHTS MiB", "KV MiB")
                + (("CACHES MiB",) if caches else ()) + ("TOTAL / NODE MiB",)]
        for s in self.stages:
            cache = (f"{(s.cache_bytes or 0) / MiB:.0f}",) if caches else ()
            rows.append((str(s.index), s.node.name, f"{s.start}-{s.end - 1}",
                         f"{s.weight_bytes / MiB:.1f}", f"{s.kv_bytes / MiB:.1f}", *cache,
                         f"{(s.total_bytes + (s.cache_bytes or 0)) / MiB:.0f} / "
                         f"{s.memory_share / MiB:.0f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.append(f"model {self.model}, n_ctx {self.n_ctx} x {self.lanes} lanes, "
                     f"wire {self.wire_dtype}")
        if self.link_ms is not None:
            lines.append(f"links: {self.link_ms:.1f} ms a token ({len(self.stages) + 1} "
                         f"hops, {link_costs.BOUNDARY_MS:.0f} ms a stage boundary)")
        lines.append(f"topology digest {self.digest}")
        return "\n".join(lines)


def check_cuts(ranges: Sequence[tuple[int, int]], groups: Iterable[tuple[int, int]]) -> None:
    """Raise PlanError if a stage boundary falls inside a keep-together group [a, b)."""
    for a, b in groups:
        for _, end in ranges[:-1]:
            if a < end < b:
                raise PlanError(f"a cut after layer {end - 1} splits layers {a}-{b - 1}, "
                                "which the family keeps in one stage")


def plan(model: ModelFacts, nodes: Sequence[NodeSpec], *, wire_dtype: str = "f16",
         n_ctx: int = DEFAULT_N_CTX, lanes: int = DEFAULT_LANES, max_stages: int | None = None,
         stages: int | None = None, ranges: Sequence[tuple[int, int]] | None = None,
         overhead_bytes: int = STAGE_OVERHEAD_BYTES, cache_bytes: int | None = None) -> Plan:
    """Place `model` on `nodes`.

    Without `stages`: the fewest stages (at most `max_stages`, at most one per node) whose
    every stage fits its node, on the nodes with the most memory. With `stages`: exactly
    that many; when there are more stages than nodes, a node's memory is shared by the
    stages it holds. Ranges are contiguous, at least one layer each, sized in proportion
    to node memory (minimising sum(load^2 / capacity)) — on a single node, even — with no
    cut inside a keep-together group. With `ranges`: exactly those (contiguous, covering
    every layer), placed and checked as a split of the planner's own. The node order, and
    so the ranges and digest, depend only on node memories, never on names or input
    order. `cache_bytes`: what each stage's caches may hold; a stage gets it where its
    node share has room after its weights, KV and overhead, else what room there is (a
    cache never decides where a stage goes or whether the model fits: it holds what is
    left). Raises PlanError saying why it cannot.
    """
    if not nodes:
        raise PlanError("no nodes to place the model on")
    if lanes < 1 or n_ctx < 1:
        raise PlanError(f"n_ctx and lanes must be at least 1 (n_ctx {n_ctx}, lanes {lanes})")
    n_ctx = min(n_ctx, model.context_length)
    costs = [w + lanes * (n_ctx * kv + st) for w, kv, st in
             zip(model.layer_bytes, model.kv_bytes_per_token, model.state_bytes)]
    cuts = _allowed_cuts(model)
    # Memory first; lower latency, then name, only choose among equal memories.
    ranked = sorted(nodes, key=lambda n: (-n.memory, n.latency_ms or 0.0, n.name))
    if ranges is not None:
        _check_cover(ranges, model.n_layers)
        stages = len(ranges)
    if stages is not None:
        if stages < 1:
            raise PlanError(f"stages must be at least 1, not {stages}")
        if stages > model.n_layers:
            raise PlanError(f"cannot cut {model.n_layers} layers into {stages} stages "
                            "(each stage needs at least one layer)")
        tries = [stages]
    else:
        if max_stages is not None and max_stages < 1:
            raise PlanError(f"max_stages must be at least 1, not {max_stages}")
        limit = min(len(ranked), model.n_layers, max_stages or len(ranked))
        tries = list(range(1, limit + 1))
    # without link figures: the fewest stages that fit, on the nodes with the most memory;
    # with them, the stage count and nodes whose links cost a token least (links.py)
    frame = model.hidden * link_costs.WIRE_BYTES.get(wire_dtype, 4)
    linked = link_costs.known(ranked)
    best = None
    for k in tries:
        for slots in _placements(ranked, k, frame, linked):
            caps = [share - overhead_bytes - model.shared_bytes
                    - (model.first_bytes if i == 0 else 0)
                    - (model.last_bytes if i == k - 1 else 0)
                    for i, (_, share) in enumerate(slots)]
            split = _ranges_for(model, costs, caps, cuts, ranges, len(ranked) == 1)
            if split is None:
                continue
            if not linked:
                need = [sum(costs[a:b]) + share - cap
                        for (a, b), (_, share), cap in zip(split, slots, caps)]
                slots = _near_parts(model, slots, split, need)
                return _build(model, slots, split, wire_dtype, n_ctx, lanes, overhead_bytes,
                              cache_bytes)
            ms = link_costs.path_ms([n for n, _ in slots], frame)
            if best is None or ms < best[0]:  # the first among equals: fewer stages
                best = (ms, slots, split)
    if best is not None:
        ms, slots, split = best
        return _build(model, slots, split, wire_dtype, n_ctx, lanes, overhead_bytes,
                      cache_bytes, ms)
    raise PlanError(_why_not(model, ranked, costs, tries[-1], stages is not None,
                             overhead_bytes, n_ctx, lanes))


def _ranges_for(model: ModelFacts, costs: list[int], caps: list[int], cuts: list[bool],
                given: Sequence[tuple[int, int]] | None,
                one_node: bool) -> list[tuple[int, int]] | None:
    """The split into len(caps) stages, or None if it does not fit: the caller's ranges,
    the even split on one node, else the memory-proportional one."""
    if given is None and not one_node:
        return _split(costs, caps, cuts)
    split = list(given) if given is not None else \
        even_ranges(model.n_layers, len(caps), model.keep_together)
    check_cuts(split, model.keep_together)
    fits = all(sum(costs[a:b]) <= cap for (a, b), cap in zip(split, caps))
    return split if fits else None


def _check_cover(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    """PlanError unless `ranges` are contiguous, non-empty, and cover [0, n_layers)."""
    ends = [0] + [b for _, b in ranges]
    if not ranges or any(a != ends[i] or b <= a for i, (a, b) in enumerate(ranges)) \
            or ends[-1] != n_layers:
        raise PlanError(f"layer ranges {list(ranges)} must be contiguous, each at least "
                        f"one layer, and cover the model's {n_layers} layers")


def _allowed_cuts(model: ModelFacts) -> list[bool]:
    """allowed[c]: a stage may end before layer c (c in 1..n-1)."""
    allowed = [True] * (model.n_layers + 1)
    for a, b in model.keep_together:
        if not (0 <= a < b <= model.n_layers):
            raise PlanError(f"keep-together group {a}-{b - 1} is outside the model's "
                            f"{model.n_layers} layers")
        for c in range(a + 1, b):
            allowed[c] = False
    return allowed


def _slots(ranked: list[NodeSpec], k: int) -> list[tuple[NodeSpec, int]]:
    """k (node, memory share) slots in pipeline order. k <= nodes: the k largest, one stage
    each. More stages than nodes: every node holds a contiguous run of stages, as many as
    its share of memory suggests, and splits its memory evenly among them."""
    if k <= len(ranked):
        return [(n, n.memory) for n in ranked[:k]]
    total = sum(n.memory for n in ranked)
    counts = [max(1, k * n.memory // total) for n in ranked]
    while sum(counts) > k:  # take back from the node with the smallest share per stage
        i = min((i for i, c in enumerate(counts) if c > 1),
                key=lambda i: ranked[i].memory / counts[i])
        counts[i] -= 1
    while sum(counts) < k:  # give to the node with the largest share per stage
        i = max(range(len(ranked)), key=lambda i: ranked[i].memory / (counts[i] + 1))
        counts[i] += 1
    return [(n, n.memory // c) for n, c in zip(ranked, counts) for _ in range(c)]


# Nodes whose every subset is tried for a pipeline when links are known (the rest: never
# one of a pipeline's nodes unless it has more stages than these)
LINKED_CANDIDATES = 8


def _placements(ranked: list[NodeSpec], k: int, frame: int, linked: bool
                ) -> Iterable[list[tuple[NodeSpec, int]]]:
    """The (node, memory share) slots to try for k stages: without links, the memory
    order's; with them, each set of k of the largest nodes in its cheapest order."""
    if not linked or k > len(ranked):
        yield _slots(ranked, k)
        return
    for group in itertools.combinations(ranked[:max(k, LINKED_CANDIDATES)], k):
        yield [(n, n.memory) for n in link_costs.best_order(group, frame)]


# Placements tried when nodes hold package parts: every order of up to this many stages.
LOCALITY_MAX_STAGES = 8


def _near_parts(model: ModelFacts, slots: list[tuple[NodeSpec, int]],
                ranges: list[tuple[int, int]], need: list[int]) -> list[tuple[NodeSpec, int]]:
    """The same ranges on the same nodes, each stage on a node that already holds most of
    its layers' bytes (package parts copied there), where the stage fits (`need`: its
    bytes). Ranges, and so the digest, do not change; with no parts anywhere, or a node
    holding several stages, the memory order stays."""
    k = len(slots)
    if not any(n.layers for n, _ in slots) or len({n.name for n, _ in slots}) < k \
            or k > LOCALITY_MAX_STAGES:
        return slots

    def held(node: NodeSpec, stage: int) -> int:
        a, b = ranges[stage]
        return sum(model.layer_bytes[i] for i in range(a, b) if i in node.layers)

    best, best_score = tuple(range(k)), sum(held(slots[i][0], i) for i in range(k))
    for order in itertools.permutations(range(k)):
        if all(need[st] <= slots[n][1] for st, n in enumerate(order)):
            score = sum(held(slots[n][0], st) for st, n in enumerate(order))
            if score > best_score:
                best, best_score = order, score
    return [slots[n] for n in best]


def _split(costs: list[int], caps: list[int], allowed: list[bool]) -> list[tuple[int, int]] | None:
    """Contiguous ranges, one per capacity, each within it, minimising sum(load^2 / cap):
    its optimum puts load in proportion to capacity. None if no split fits."""
    n, k = len(costs), len(caps)
    if k > n or min(caps) <= 0:
        return None
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: least score placing layers [0, i) on the first j stages; back: its cut
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        cap = caps[j - 1]
        last = j == k
        for i in range(j, n - (k - j) + 1):
            if not last and not allowed[i] or (last and i != n):
                continue
            for s in range(j - 1, i):
                if best[j - 1][s] == inf:
                    continue
                load = prefix[i] - prefix[s]
                if load > cap:
                    continue
                score = best[j - 1][s] + load * load / cap
                if score < best[j][i]:
                    best[j][i], back[j][i] = score, s
    if best[k][n] == inf:
        return None
    ranges, end = [], n
    for j in range(k, 0, -1):
        start = back[j][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def stage_bytes(model: ModelFacts, ranges: Sequence[tuple[int, int]], *, n_ctx: int,
                lanes: int) -> list[tuple[int, int]]:
    """Each stage's (weight bytes, KV and recurrent-state bytes of `lanes` lanes of
    n_ctx tokens) for a split of `model` into `ranges`: what a plan reserves for it."""
    n_ctx = min(n_ctx, model.context_length)
    out = []
    for i, (a, b) in enumerate(ranges):
        weights = sum(model.layer_bytes[a:b]) + model.shared_bytes \
            + (model.first_bytes if i == 0 else 0) \
            + (model.last_bytes if i == len(ranges) - 1 else 0)
        kv = lanes * sum(n_ctx * kv + st for kv, st in
                         zip(model.kv_bytes_per_token[a:b], model.state_bytes[a:b]))
        out.append((weights, kv))
    return out


def _build(model: ModelFacts, slots: list[tuple[NodeSpec, int]], ranges: list[tuple[int, int]],
           wire_dtype: str, n_ctx: int, lanes: int, overhead: int,
           cache: int | None = None, link_ms: float | None = None) -> Plan:
    check_cuts(ranges, model.keep_together)
    out = []
    sizes = stage_bytes(model, ranges, n_ctx=n_ctx, lanes=lanes)
    for i, ((node, share), (a, b), (weights, kv)) in enumerate(zip(slots, ranges, sizes)):
        room = None if cache is None else min(cache, max(0, share - weights - kv - overhead))
        out.append(StagePlan(i, a, b, node, weights, kv, overhead, share, room))
    digest = topology_digest(model.model_digest, ranges, wire_dtype)
    return Plan(model.name, model.model_digest, wire_dtype, n_ctx, lanes, tuple(out), digest,
                link_ms)


def _why_not(model: ModelFacts, ranked: list[NodeSpec], costs: list[int], k: int,
             exact: bool, overhead: int, n_ctx: int, lanes: int) -> str:
    gib = 2**30
    need = sum(costs) + model.first_bytes + model.last_bytes + model.shared_bytes + overhead
    have = sum(n.memory for n in ranked)
    sizing = f"n_ctx {n_ctx} x {lanes} lanes"
    if need > have:
        return (f"{model.name} needs at least {need / gib:.2f} GiB in total (weights, KV for "
                f"{sizing}, overhead) but the nodes have {have / gib:.2f} GiB")
    biggest = ranked[0]
    groups = [(a, b) for a, b in model.keep_together] + \
        [(i, i + 1) for i in range(model.n_layers)]
    a, b = max(groups, key=lambda g: sum(costs[g[0]:g[1]]))
    unit = sum(costs[a:b]) + model.shared_bytes + overhead
    if unit > biggest.memory:
        what = f"layer {a}" if b == a + 1 else f"layers {a}-{b - 1} (kept together)"
        return (f"{model.name}: the largest {what} needs {unit / MiB:.0f} MiB (weights, KV "
                f"for {sizing}, overhead) but the largest node, {biggest.name}, has "
                f"{biggest.memory / MiB:.0f} MiB")
    count = f"exactly {k}" if exact else f"at most {k}"
    return (f"{model.name}: no split into {count} stage(s) fits these nodes "
            f"(needs {need / gib:.2f} GiB of {have / gib:.2f} GiB; the embeddings "
            f"({model.first_bytes / MiB:.0f} MiB) and head ({model.last_bytes / MiB:.0f} MiB) "
            "sit on the first and last stages); add memory or nodes, or lower n_ctx / lanes")
