"""The links between a cluster's nodes, measured for the planner (topology/links.py).

Each node times TCP connects to every other node's raylet (its node manager port, which
every node reaches: DESIGN.md §9, deploy/README.md's ports): a connect is one round
trip, so half the best of a few is the one-way latency. The gateway runs on the head (the
driver's node), so a node's link to the head is its `latency_ms`.

Figures are kept in steps of RESOLUTION_MS, and a link under it counts as none: a LAN's
fractions of a millisecond, a busy node's slow connect, and their noise must not move a
plan (its ranges, and so its digest, which the caches are keyed by, follow the nodes it
picks). Any failure leaves the nodes without link figures: planned by memory, as
without this.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from skippy.topology.links import Link
from skippy.topology.planner import NodeSpec

from ..stage.channels import HOST_DELAY_ENV, host_delay_s

log = logging.getLogger(__name__)

RESOLUTION_MS = 5.0
CONNECTS = 3          # tries per link; the best counts
CONNECT_S = 1.0       # a connect slower than this: the link is left unknown
PROBE_S = 30.0        # every node's answers, at most


def one_way_ms(host: str, port: int, tries: int = CONNECTS) -> float | None:
    """Half the best TCP connect time to host:port, in ms; None if it cannot connect."""
    best = None
    for _ in range(tries):
        t = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=CONNECT_S):
                pass
        except OSError:
            return None
        best = min(best if best is not None else float("inf"), time.perf_counter() - t)
    return best / 2 * 1e3


def rounded(ms: float | None) -> float | None:
    """A measured latency to the nearest RESOLUTION_MS; None where it is unknown or under
    RESOLUTION_MS."""
    if ms is None or ms < RESOLUTION_MS:
        return None
    return float(RESOLUTION_MS * round(ms / RESOLUTION_MS))


@ray.remote(num_cpus=0)
def _from_here(targets: list[tuple[str, str, int]]) -> dict[str, float | None]:
    here = ray.util.get_node_ip_address()
    return {node: _shaped(here, host, one_way_ms(host, port)) for node, host, port in targets}


def _shaped(here: str, there: str, ms: float | None) -> float | None:
    """A measured link with the host test hook's delay on it (channels.HOST_DELAY_ENV:
    links shaped where the kernel has no netem)."""
    return None if ms is None else ms + host_delay_s(here, there) * 1e3


def with_links(nodes: Sequence[NodeSpec], raw: Sequence[dict]) -> list[NodeSpec]:
    """`nodes` (named by Ray node id) with their measured links: `raw` is ray.nodes()'s
    entries for them. Unchanged where there is one node, or the probe fails."""
    if len(nodes) < 2:
        return list(nodes)
    where = {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in raw}
    head = ray.get_runtime_context().get_node_id()
    try:
        hook = {"runtime_env": {"env_vars": {HOST_DELAY_ENV: os.environ[HOST_DELAY_ENV]}}} \
            if os.environ.get(HOST_DELAY_ENV) else {}
        asked = [_from_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node.name, soft=False), **hook).remote(
                [(other, *where[other]) for other in where if other != node.name])
            for node in nodes]
        measured = ray.get(asked, timeout=PROBE_S)
    except Exception as e:  # a node that cannot run the probe: no links, plan by memory
        log.warning("links between nodes not measured (%s): planning by memory", e)
        return list(nodes)
    return measured_links(nodes, measured, head)


def measured_links(nodes: Sequence[NodeSpec], measured: Sequence[dict[str, float | None]],
                   head: str) -> list[NodeSpec]:
    """`nodes` with the one-way ms each measured to the others (`measured`, in the same
    order; None: could not connect): links to the other nodes, `latency_ms` to the head
    (0 for the head itself), each rounded. Unchanged where no link is RESOLUTION_MS or
    more."""
    out = []
    for node, ms in zip(nodes, measured):
        links = {other: Link(r) for other, v in ms.items()
                 if other != head and (r := rounded(v)) is not None}
        latency = 0.0 if node.name == head else rounded(ms.get(head))
        out.append(dataclasses.replace(node, links=links, latency_ms=latency))
    if not any(n.links or n.latency_ms for n in out):
        return list(nodes)  # a LAN: nothing for the plan to weigh
    return out
