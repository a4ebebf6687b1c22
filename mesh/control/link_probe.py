"""The links between a cluster's nodes, measured for the planner (topology/links.py).

Each node times TCP connects to every other node's raylet (its node manager port, which
every node reaches: DESIGN.md §9, deploy/README.md's ports): a connect is one round
trip, so half the best of a few is the one-way latency. The gateway runs on the head (the
driver's node), so a node's link to the head is its `latency_ms`.

Each node also sends a burst to every other node's sink (an actor per node, one pair at
a time so no two bursts share a link): its bytes over the time to the sink's answer, less
two round trips, are the link's bandwidth, which a frame row crosses on every token.

Figures are kept in steps of RESOLUTION_MS, and a link under it counts as none: a LAN's
fractions of a millisecond, a busy node's slow connect, and their noise must not move a
plan (its ranges, and so its digest, which the caches are keyed by, follow the nodes it
picks). Bandwidths likewise: a power of two of MB/s, and none from FAST_BPS up (a LAN).
Any failure leaves the nodes without link figures: planned by memory, as without this.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
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
BURST_BYTES = 4 << 20  # a bandwidth probe's most bytes...
BURST_S = 0.25         # ...and its longest send: a slow link is timed on what it carried
FAST_BPS = 100e6       # bytes/s from which a link does not count as limiting (a LAN)


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


def rounded_rate(bps: float | None) -> float | None:
    """A measured bandwidth (bytes/s) down to a power of two of MB/s; None where it is
    unknown or FAST_BPS or more."""
    if bps is None or bps >= FAST_BPS:
        return None
    return 1e6 * 2.0 ** math.floor(math.log2(max(bps / 1e6, 2.0 ** -10)))


class Sink:
    """Takes bursts on a port of `host`: each connection's bytes until the sender stops
    writing, answered with their count (8 bytes)."""

    def __init__(self, host: str):
        self.server = socket.create_server((host, 0))
        self.address = (host, self.server.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True, name="link-sink").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(PROBE_S)
                got = 0
                try:
                    while chunk := conn.recv(1 << 16):
                        got += len(chunk)
                    conn.sendall(got.to_bytes(8, "big"))
                except OSError:
                    pass  # the sender gave up: it counts the link unknown

    def close(self) -> None:
        self.server.close()


def burst_bps(host: str, port: int) -> float | None:
    """Bytes per second to the Sink at host:port: a burst of at most BURST_BYTES for at
    most BURST_S, timed to the sink's count, less two round trips (the connect's, and the
    last byte's way there with the count's back); None if it fails."""
    one_way = one_way_ms(host, port)  # the sink takes these connects as empty bursts
    if one_way is None:
        return None
    chunk, sent = bytes(1 << 16), 0
    t = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=PROBE_S) as s:
            while sent < BURST_BYTES and time.perf_counter() - t < BURST_S:
                s.sendall(chunk)
                sent += len(chunk)
            s.shutdown(socket.SHUT_WR)
            got = int.from_bytes(_exactly(s, 8), "big")
    except (OSError, EOFError):
        return None
    spent = time.perf_counter() - t - 4 * one_way / 1e3
    return got / max(spent, 1e-6) if got == sent else None


def _exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        if not (part := s.recv(n - len(out))):
            raise EOFError
        out += part
    return out


@ray.remote(num_cpus=0)
class _RateProbe:
    """A node's end of the bandwidth probe: its Sink, and bursts to the others'."""

    def __init__(self):
        self.sink = Sink(ray.util.get_node_ip_address())

    def address(self) -> tuple[str, int]:
        return self.sink.address

    def burst(self, host: str, port: int) -> float | None:
        return burst_bps(host, port)

    def close(self) -> None:
        self.sink.close()


def _rates(hosts: dict[str, str]) -> dict[tuple[str, str], float | None]:
    """The bandwidth (bytes/s) of each ordered pair of nodes on different hosts (`hosts`:
    node name -> address), one burst at a time; none where every node shares one host."""
    pairs = [(a, b) for a in hosts for b in hosts if hosts[a] != hosts[b]]
    if not pairs:
        return {}
    probes = {n: _RateProbe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n, soft=False)).remote() for n in hosts}
    try:
        sinks = dict(zip(probes, ray.get([p.address.remote() for p in probes.values()],
                                         timeout=PROBE_S)))
        return {(a, b): ray.get(probes[a].burst.remote(*sinks[b]), timeout=PROBE_S)
                for a, b in pairs}
    finally:
        for p in probes.values():
            ray.kill(p)


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
        rates = _rates({n.name: where[n.name][0] for n in nodes})
    except Exception as e:  # a node that cannot run the probe: no links, plan by memory
        log.warning("links between nodes not measured (%s): planning by memory", e)
        return list(nodes)
    return measured_links(nodes, measured, head, rates)


def measured_links(nodes: Sequence[NodeSpec], measured: Sequence[dict[str, float | None]],
                   head: str, rates: dict[tuple[str, str], float | None] | None = None
                   ) -> list[NodeSpec]:
    """`nodes` with the one-way ms each measured to the others (`measured`, in the same
    order; None: could not connect) and the bandwidth of each pair from its first node
    (`rates`, bytes/s): links to the other nodes, `latency_ms` to the head (0 for the head
    itself), each rounded. Unchanged where no link is RESOLUTION_MS or more and none is
    slower than FAST_BPS."""
    rates = rates or {}
    out = []
    for node, ms in zip(nodes, measured):
        links = {}
        for other, v in ms.items():
            latency, bps = rounded(v), rounded_rate(rates.get((node.name, other)))
            if other != head and (latency is not None or bps is not None):
                links[other] = Link(latency or 0.0, bps)
        latency = 0.0 if node.name == head else rounded(ms.get(head))
        out.append(dataclasses.replace(node, links=links, latency_ms=latency))
    if not any(n.links or n.latency_ms for n in out):
        return list(nodes)  # a LAN: nothing for the plan to weigh
    return out
