"""What Ray's autoscaler is asked to keep room for: every stage the served models hold,
and a whole copy more of a model whose requests wait for lanes where no node has room.

Stage actors ask Ray for no memory resource (the planner places them by node), so the
autoscaler sees them only here: Ray's `request_resources`, one standing request per
cluster, which an autoscaler meets by adding nodes of a configured type and by keeping
the nodes the request needs (a node holding stages would otherwise look idle to it).
Without an autoscaler (embedded Ray, `ray start` by hand) no one reads it. Each engine
keeps its own part; the cluster's request is all of them."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_asks: dict[int, list[dict]] = {}
_lock = threading.Lock()


def ask(owner: object, bundles: list[dict]) -> list[dict]:
    """`owner`'s part of the request is now `bundles` (each a node's share: {"memory":
    bytes}); empty withdraws it. Returns the cluster's whole request as sent."""
    import ray
    from ray.autoscaler.sdk import request_resources
    with _lock:
        if bundles:
            _asks[id(owner)] = list(bundles)
        else:
            _asks.pop(id(owner), None)
        every = [b for part in _asks.values() for b in part]
        if ray.is_initialized():
            try:
                request_resources(bundles=every)
            except Exception as e:  # noqa: BLE001 - a hint: serving goes on without it
                log.warning("the autoscaler's request was not updated: %s", e)
    return every
