"""The links between nodes, as the planner gets them (mesh/control/link_probe.py): a TCP
connect timed, in steps of 5 ms, a LAN's links left out."""

from __future__ import annotations

import socket
import threading
import time

from skippy.mesh.control.link_probe import Sink, burst_bps, measured_links, one_way_ms, \
    rounded, rounded_rate
from skippy.topology.links import Link
from skippy.topology.planner import NodeSpec


def test_a_connect_is_timed_and_a_closed_port_is_unknown():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]
        ms = one_way_ms("127.0.0.1", port)
        assert ms is not None and 0 <= ms < 50
    assert one_way_ms("127.0.0.1", port) is None  # nothing listens there now


def test_steps_of_5_ms_and_links_under_5_ms_count_as_none():
    assert rounded(None) is None and rounded(0.4) is None and rounded(4.99) is None
    assert rounded(5.2) == 5.0 and rounded(12.6) == 15.0 and rounded(41) == 40.0


def test_measured_links_go_to_the_nodes_and_the_head():
    nodes = [NodeSpec("head", 1), NodeSpec("a", 1), NodeSpec("b", 1)]
    measured = [{"a": 0.2, "b": 11.7}, {"head": 0.3, "b": 12.9}, {"head": 11.9, "a": None}]
    head, a, b = measured_links(nodes, measured, "head")
    assert head.latency_ms == 0.0 and head.links == {"b": Link(10.0)}
    assert a.latency_ms is None and a.links == {"b": Link(15.0)}
    assert b.latency_ms == 10.0 and b.links == {}  # a: not reached from b
    # a LAN (a busy node's slow connect too): every link under 5 ms, so the plan goes by
    # memory as before
    lan = [{"a": 0.2, "b": 0.4}, {"head": 0.3, "b": 3.1}, {"head": 0.5, "a": 0.2}]
    assert measured_links(nodes, lan, "head") == nodes


def test_bandwidths_in_powers_of_two_of_mb_and_a_lan_is_none():
    assert rounded_rate(None) is None and rounded_rate(100e6) is None
    assert rounded_rate(3.1e6) == 2e6 and rounded_rate(50e6) == 32e6
    assert rounded_rate(0.3e6) == 0.25e6 and rounded_rate(99e6) == 64e6


def _slow_sink(bps: float) -> tuple[socket.socket, int]:
    """The Sink's protocol, reading at most `bps` bytes a second: a slow link."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                got = 0
                while chunk := conn.recv(1 << 14):
                    got += len(chunk)
                    time.sleep(len(chunk) / bps)
                conn.sendall(got.to_bytes(8, "big"))

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_a_burst_times_the_links_bandwidth():
    sink = Sink("127.0.0.1")
    try:
        fast = burst_bps(*sink.address)
        assert fast is not None and rounded_rate(fast) is None  # loopback: not limiting
    finally:
        sink.close()
    server, port = _slow_sink(3e6)
    with server:
        slow = burst_bps("127.0.0.1", port)
    assert slow is not None and 2e6 < slow < 3.2e6 and rounded_rate(slow) == 2e6
    assert burst_bps("127.0.0.1", port) is None  # closed


def test_a_slow_link_goes_to_the_plan_even_without_latency():
    nodes = [NodeSpec("head", 1), NodeSpec("a", 1), NodeSpec("b", 1)]
    measured = [{"a": 0.2, "b": 0.3}, {"head": 0.3, "b": 0.2}, {"head": 0.5, "a": 0.2}]
    lan = {(x, y): 900e6 for x in ("head", "a", "b") for y in ("head", "a", "b") if x != y}
    assert measured_links(nodes, measured, "head", lan) == nodes
    slow = {**lan, ("head", "b"): 5e6, ("a", "b"): 12e6, ("b", "head"): 5e6}
    head, a, b = measured_links(nodes, measured, "head", slow)
    assert head.links == {"b": Link(0.0, 4e6)} and a.links == {"b": Link(0.0, 8e6)}
    assert b.links == {} and b.latency_ms is None  # its link to the head: the head's figure
