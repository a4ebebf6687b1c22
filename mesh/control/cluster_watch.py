"""A gateway that joined a Ray cluster ends with it: `ray down` (or `ray stop` on the
head) stops Ray's own processes, never its drivers, and a gateway left behind would
hold its port and answer every request with a fault. A thread connects to the cluster's
GCS port every few seconds; after a few refused connects in a row it says so and ends
the process with EXIT_CLUSTER_GONE, which the service (mesh/supervisor.py) does not
restart. An embedded Ray ends with the gateway anyway: nothing to watch.

A worker node's Ray is left behind the same way (`ray down` runs `ray stop` on the head
only: a worker's raylet ends a minute later, its log monitor never), so the YAMLs start
this module beside a worker's Ray: `python -m skippy.mesh.control.cluster_watch
HEAD:6379` runs `ray stop` on its node once the head's GCS is gone, then ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


def _replace_earlier(pid_file: Path) -> None:
    """One watcher a node: an earlier one (a Ray started before this one) ends here, or
    it would stop the new Ray when the head's GCS restarts."""
    try:
        pid = int(pid_file.read_text())
        if b"cluster_watch" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, 15)
    except (OSError, ValueError):
        pass  # none, or gone
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(str(os.getpid()))


def stop_ray_when_gone(address: str, pid_file: Path, ray: str,
                       check_s: float = CHECK_S) -> int:
    """Wait for the GCS at `address` to go, then `ray stop` here (the exit status)."""
    _replace_earlier(pid_file)
    done = threading.Event()
    watch(address, lambda m: print(m, flush=True), gone=done.set, check_s=check_s,
          then="ray stop on this node")
    done.wait()
    return subprocess.run([ray, "stop"]).returncode


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or ":" not in args[0]:
        print("usage: python -m skippy.mesh.control.cluster_watch HEAD:PORT", file=sys.stderr)
        return 2
    from ..models import model_home
    ray = str(Path(sys.executable).parent / "ray")  # the venv's, whatever PATH says
    return stop_ray_when_gone(args[0], model_home() / "node-watch.pid", ray)


if __name__ == "__main__":
    sys.exit(main())
