"""What a pipeline's links cost a token, and the order of nodes that costs least.

A decode step's token goes from the gateway to stage 0, from each stage to the next, and
from the last stage straight back to the gateway (DESIGN.md §4): k stages cross k + 1
links. Each costs its one-way latency; between stages the frame (one hidden row at the
wire's dtype) also takes its bytes over the link's bandwidth (a token id to or from the
gateway weighs nothing). A stage boundary also costs a fixed BOUNDARY_MS (its session,
serialization and thread hand-offs: 2 stages on one node cost about 1 ms a token more
than 1, evals/README.md).

A node's `latency_ms` is its link to the gateway (unknown: 0); `links` maps other nodes'
names to theirs (either end may give a pair; the first found counts). A pair nobody gives
is taken as the way through the gateway's network: the two ends' latencies added. Without
any link figures only the boundaries count, and the fewest stages win.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

BOUNDARY_MS = 1.0
WIRE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
# orders tried for a pipeline's nodes: every one up to this many stages, else as given
MAX_ORDERED = 7


@dataclass(frozen=True)
class Link:
    latency_ms: float = 0.0
    bandwidth: float | None = None  # bytes per second; None: not limiting


class NodeSpec(Protocol):
    """What of a planner node (topology/planner.py) its links are."""
    name: str
    latency_ms: float | None
    links: Mapping[str, Link]


def known(nodes: Sequence[NodeSpec]) -> bool:
    """Whether any node says anything of its links."""
    return any(n.latency_ms is not None or n.links for n in nodes)


def between(a: NodeSpec, b: NodeSpec) -> Link:
    if a.name == b.name:
        return Link()  # stages sharing a node: no network between them
    return a.links.get(b.name) or b.links.get(a.name) or \
        Link((a.latency_ms or 0.0) + (b.latency_ms or 0.0))


def path_ms(nodes: Sequence[NodeSpec], frame_bytes: int) -> float:
    """A token's time on the links of a pipeline over `nodes` (stage order), boundaries
    included."""
    total = (nodes[0].latency_ms or 0.0) + (nodes[-1].latency_ms or 0.0)
    for a, b in zip(nodes, nodes[1:]):
        link = between(a, b)
        total += link.latency_ms + BOUNDARY_MS
        if link.bandwidth:
            total += frame_bytes / link.bandwidth * 1e3
    return total


def best_order(nodes: Sequence[NodeSpec], frame_bytes: int) -> tuple[NodeSpec, ...]:
    """The order of `nodes` whose path costs least (the given order among equals, and
    beyond MAX_ORDERED nodes)."""
    if len(nodes) > MAX_ORDERED:
        return tuple(nodes)
    return min(itertools.permutations(nodes), key=lambda o: path_ms(o, frame_bytes))
