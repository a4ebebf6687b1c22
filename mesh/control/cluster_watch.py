"""A gateway that joined a Ray cluster ends with it: `ray down` (or `ray stop` on the
head) stops Ray's own processes, never its drivers, and a gateway left behind would
hold its port and answer every request with a fault. A thread connects to the cluster's
GCS port every few seconds; after a few refused connects in a row it says so and ends
the process with EXIT_CLUSTER_GONE, which the service (mesh/supervisor.py) does not
restart. An embedded Ray ends with the gateway anyway: nothing to watch."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

EXIT_CLUSTER_GONE = 75  # sysexits' EX_TEMPFAIL: the cluster may come back, later
CHECK_S = 2.0
MISSES = 3  # refused connects in a row (a GCS restarting answers again within them)


def watch(gcs_address: str, say: Callable[[str], None],
          gone: Callable[[], None] = lambda: os._exit(EXIT_CLUSTER_GONE),
          check_s: float = CHECK_S, then: str = "the gateway ends with it") -> threading.Thread:
    """Watch the GCS at host:port; `gone()` once it refused MISSES connects in a row
    (`then` says what follows)."""
    host, port = gcs_address.rsplit(":", 1)

    def run() -> None:
        misses = 0
        while misses < MISSES:
            time.sleep(check_s)
            try:
                with socket.create_connection((host, int(port)), timeout=check_s):
                    misses = 0
            except OSError:
                misses += 1
        say(f"skippy: the Ray cluster at {gcs_address} is gone (ray down or ray stop): "
            f"{then}")
        gone()

    thread = threading.Thread(target=run, daemon=True, name="cluster-watch")
    thread.start()
    return thread

