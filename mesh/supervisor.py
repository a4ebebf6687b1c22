"""The service's supervisor: mesh/service.py starts it detached (`python -m
skippy.mesh.supervisor`); it runs `skippy serve` as its child, starts it again when it
exits on its own, and keeps state.json up to date for `skippy status`.

It stays a small process of its own (exec'd, not forked from the CLI, which has torch
loaded by then). The gateway dies with it (PR_SET_PDEATHSIG): a gateway nobody supervises
would hold the port against the next start.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cli import EXIT_USAGE
from .control.cluster_watch import EXIT_CLUSTER_GONE
from .service import SUPERVISOR_MARK, ServiceState, process_start, state_path, write_state

GRACE_S = 30.0  # a stopping gateway closes its stages; after this it is killed
# How the gateway is asked to stop: uvicorn shuts down on SIGINT as on SIGTERM, and before
# it serves, SIGINT is a KeyboardInterrupt (the CLI's "interrupted"), where Ray's handler
# would answer SIGTERM with a stack dump in the log.
STOP_SIGNAL = signal.SIGINT
_PR_SET_PDEATHSIG = 1
LOG_MAX_BYTES = 64 * 2**20  # then the log moves to gateway.log.1 (one old file is kept)


@dataclass
class RestartPolicy:
    """When to start the gateway again after it exited: 1 s after a run that lasted at
    least `stable_s`, then doubling while runs stay shorter (a crash loop: 1, 2, 4, 8 s),
    and not at all after `max_rapid` short runs in a row, after exit code 2 (the CLI's
    for refused options, which would be refused again), or after EXIT_CLUSTER_GONE (the
    Ray cluster it served was taken down: mesh/control/cluster_watch.py)."""
    first_delay_s: float = 1.0
    stable_s: float = 60.0
    max_rapid: int = 5
    rapid: int = 0

    def after_exit(self, code: int, ran_s: float) -> float | None:
        """Seconds to wait before the next start, or None: give up."""
        if code in (EXIT_USAGE, EXIT_CLUSTER_GONE):
            return None
        self.rapid = self.rapid + 1 if ran_s < self.stable_s else 0
        if self.rapid >= self.max_rapid:
            return None
        return self.first_delay_s * 2 ** max(self.rapid - 1, 0)

    def why_not(self, code: int) -> str:
        if code == EXIT_USAGE:
            return "skippy serve refused its options (exit code 2)"
        if code == EXIT_CLUSTER_GONE:
            return "the Ray cluster it served is gone (ray down or ray stop)"
        return (f"it exited {self.rapid} times in a row within {self.stable_s:g} s of "
                f"starting (last exit code {code})")


def _private_append(path: Path):
    """`path` opened to append, made 0600 (a file left more open by an older version is
    closed too); a symlink at its name is an OSError rather than followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


class LogFile:
    """The service's log, rotated past `max_bytes`: serve's output comes through a pipe
    and is written here, so that a gateway up for months (a line per request) does not
    fill the head's disk. The supervisor's own lines go here too. Private to its user
    (0600, a symlink at its name refused): what the gateway prints may quote requests."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._lock = threading.Lock()
        self._file = _private_append(path)

    def write(self, data: bytes) -> None:
        with self._lock:
            self._file.write(data)
            self._file.flush()
            if self._file.tell() >= self.max_bytes:
                self._file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._file = _private_append(self.path)

    def say(self, message: str) -> None:
        self.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}{SUPERVISOR_MARK}{message}\n"
                   .encode())

    def pump(self, stream) -> None:
        """Copy `stream` (a child's output) here, line by line, to its end. A line that
        cannot be written (a full disk) is dropped: a pipe left unread would stall the
        gateway at its next print."""
        for line in iter(stream.readline, b""):
            try:
                self.write(line)
            except OSError:
                pass


class Supervisor:
    def __init__(self, state: ServiceState, policy: RestartPolicy, log: LogFile):
        self.state, self.policy, self.log = state, policy, log
        self.say = log.say
        self.stop_asked: float | None = None  # when SIGTERM or SIGINT came (monotonic)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no terminal: a hangup means nothing
        code, ran = self._run_gateway()
        while self.stop_asked is None:
            delay = self.policy.after_exit(code, ran)
            self.state.last_exit, self.state.gateway_pid = code, None
            if delay is None:
                return self._give_up(code)
            self.state.phase = "restarting"
            write_state(self.state)
            self.say(f"the gateway exited (code {code}) after {ran:.0f} s; starting it "
                     f"again in {delay:g} s")
            self._sleep(delay)
            if self.stop_asked is not None:
                break
            self.state.restarts += 1
            code, ran = self._run_gateway()
        self.say("stopped")
        state_path().unlink(missing_ok=True)
        return 0

    def _on_stop(self, _signum, _frame) -> None:
        if self.stop_asked is None:
            self.stop_asked = time.monotonic()

    def _run_gateway(self) -> tuple[int, float]:
        """One run of `skippy serve`: (its exit code, seconds it ran)."""
        began = time.monotonic()
        child = subprocess.Popen(
            [sys.executable, "-m", "skippy.mesh.cli", "serve", *self.state.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
        pump = threading.Thread(target=self.log.pump, args=(child.stdout,), daemon=True)
        pump.start()
        s = self.state
        s.gateway_pid, s.gateway_start = child.pid, process_start(child.pid)
        s.gateway_started_at, s.phase = time.time(), "running"
        write_state(s)
        self.say(f"gateway started (pid {child.pid}): skippy serve {shlex.join(s.args)}")
        code = self._wait(child)
        pump.join(timeout=5)  # its last lines, unless a process it left holds the pipe
        if not pump.is_alive():
            child.stdout.close()
        return code, time.monotonic() - began

    def _wait(self, child: subprocess.Popen) -> int:
        """The child's exit code; a stop request is passed on to it (STOP_SIGNAL, then
        SIGKILL after GRACE_S). Polls, so that a signal between Popen and here is seen."""
        asked = False
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_asked is not None and not asked:
                child.send_signal(STOP_SIGNAL)
                asked = True
            if asked and time.monotonic() - self.stop_asked > GRACE_S:
                child.kill()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.stop_asked is None and time.monotonic() < end:
            time.sleep(0.1)

    def _give_up(self, code: int) -> int:
        self.state.phase, self.state.reason = "failed", self.policy.why_not(code)
        write_state(self.state)
        self.say(f"not starting the gateway again: {self.state.reason}")
        return 1


def _die_with_parent() -> None:
    """In the child, before exec (Linux): STOP_SIGNAL when the supervisor dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, STOP_SIGNAL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="skippy.mesh.supervisor")
    p.add_argument("--notify-fd", type=int, required=True,
                   help="the pipe on which the starting `skippy service start` waits")
    p.add_argument("--url", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("serve_args", nargs="*")
    a = p.parse_args(argv)
    pid = os.getpid()
    state = ServiceState(supervisor_pid=pid, supervisor_start=process_start(pid), url=a.url,
                         log=a.log, args=a.serve_args, started_at=time.time())
    write_state(state)
    os.write(a.notify_fd, str(pid).encode())
    os.close(a.notify_fd)
    return Supervisor(state, RestartPolicy(), LogFile(Path(a.log))).run()


if __name__ == "__main__":
    sys.exit(main())
