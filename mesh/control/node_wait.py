"""Waiting for a Ray cluster's nodes before the plan is made (`skippy serve --wait-nodes
N`): `ray up` starts the gateway on the head while the autoscaler still brings the
workers up, and a plan made then would put every stage on the head."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray


def wait_for_nodes(n: int, progress: Callable[[str], None], poll_s: float = 2.0) -> int:
    """Block until the cluster this driver joined has at least `n` alive nodes; says how
    many have joined each time that changes. Returns the number alive."""
    said = None
    while True:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive >= n:
            if said is not None:
                progress(f"{alive} Ray nodes joined")
            return alive
        if alive != said:
            progress(f"waiting for {n} Ray nodes ({alive} joined)")
            said = alive
        time.sleep(poll_s)
