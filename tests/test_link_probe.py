"""The links between nodes, as the planner gets them (mesh/control/link_probe.py): a TCP
connect timed, in steps of 5 ms, a LAN's links left out."""

from __future__ import annotations

import socket

from skippy.mesh.control.link_probe import measured_links, one_way_ms, rounded
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
