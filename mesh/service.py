"""The gateway as a managed, detached service on this machine: `skippy service
start|stop|restart` and `skippy status`.

`ray up` runs `skippy service start -- <serve options>` on the head (deploy/*.yaml) from
an SSH session that ends right after, so the service detaches: a double fork into a
session of its own (it can never take a terminal, and the session's hangup does not reach
it), stdin from /dev/null, output to a log file. There it runs a small supervisor
(mesh/supervisor.py) that runs `skippy serve` as its child and starts it again when it
exits. No systemd: Ray's nodes (containers, plain VMs) may not have it.

Files, in $SKIPPY_HOME/service/ (default ~/.cache/skippy/service):
    state.json    the supervisor's and the gateway's pids, URL, start times, restarts
    gateway.log   the supervisor's lines and the gateway's output; a new start keeps the
                  previous one's as gateway.log.1
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 60.0  # the supervisor gives the gateway 30 s to close its stages
SUPERVISOR_MARK = " skippy service: "  # in each line the supervisor writes to the log


class ServiceError(Exception):
    """The service cannot do what was asked (one line for the CLI)."""


@dataclass
class ServiceState:
    """What state.json holds. `*_start` are the processes' kernel start times, so that
    a pid reused by another process after a reboot or a crash is not taken for ours."""
    supervisor_pid: int
    url: str
    log: str
    args: list[str]
    started_at: float
    supervisor_start: int | None = None
    gateway_pid: int | None = None
    gateway_start: int | None = None
    gateway_started_at: float | None = None
    restarts: int = 0
    phase: str = "starting"  # running | restarting | failed
    last_exit: int | None = None
    reason: str = ""  # why it gave up (phase "failed")

    @classmethod
    def from_json(cls, text: str) -> ServiceState:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def service_home() -> Path:
    # as mesh.models.model_home, without its imports: the supervisor stays small
    env = os.environ.get("SKIPPY_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "skippy"
    return home / "service"


def state_path() -> Path:
    return service_home() / "state.json"


def log_path() -> Path:
    return service_home() / "gateway.log"


def write_state(state: ServiceState) -> None:
    """Atomically: `skippy status` never reads half a file."""
    path = state_path()
    tmp = path.with_name(f".state.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(state), indent=1) + "\n")
    os.replace(tmp, path)


def read_state() -> ServiceState | None:
    try:
        return ServiceState.from_json(state_path().read_text())
    except (OSError, ValueError, TypeError):
        return None


def process_start(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if it is gone or
    a zombie (an exited process its parent has not reaped: a container's bare init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return None if fields[0] == "Z" else int(fields[19])  # fields 3 and 22


def alive(pid: int | None, start: int | None) -> bool:
    if not pid:
        return False
    if not Path("/proc/self/stat").exists():  # no procfs: trust the pid alone
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return process_start(pid) == start if start is not None else process_start(pid) is not None


def current() -> ServiceState | None:
    """The service as state.json describes it, if its supervisor runs (or it gave up,
    which status still reports); a state left by a supervisor that is gone is removed."""
    state = read_state()
    if state is None:
        return None
    if state.phase == "failed" or alive(state.supervisor_pid, state.supervisor_start):
        return state
    state_path().unlink(missing_ok=True)
    return None


def probe_url(url: str) -> str:
    """Where this machine reaches a gateway bound to `url` (a wildcard host: loopback)."""
    for wildcard in ("//0.0.0.0:", "//[::]:", "//:"):
        url = url.replace(wildcard, "//127.0.0.1:")
    return url


def health(url: str, timeout_s: float = 2.0) -> str:
    """The gateway's /health status ("ok", "degraded"), or "no answer"."""
    try:
        with urllib.request.urlopen(probe_url(url) + "/health", timeout=timeout_s) as r:
            return json.loads(r.read()).get("status", "no answer")
    except (OSError, ValueError, urllib.error.URLError):
        return "no answer"


# -- start --------------------------------------------------------------------------------------
def start(serve_args: list[str], url: str, wait_s: float = 0.0,
          say=lambda _m: None) -> ServiceState:
    """Start the service (a running one is stopped first, so that `ray up` again applies
    the YAML's options); with `wait_s`, return once the gateway answers /health."""
    old = stop()
    if old is not None and old.phase != "failed":
        say(f"stopped the gateway that ran (pid {old.gateway_pid})")
    service_home().mkdir(parents=True, exist_ok=True)
    log = log_path()
    if log.exists():
        os.replace(log, log.with_name(log.name + ".1"))
    pid = _spawn_supervisor(serve_args, url, log)
    state = read_state()
    if state is None or state.supervisor_pid != pid:
        raise ServiceError(f"the service did not start; see {log}")
    if wait_s > 0:
        state = _wait_until_healthy(wait_s)
    return state


def _spawn_supervisor(serve_args: list[str], url: str, log: Path) -> int:
    """Double fork, then exec the supervisor in the grandchild: a new session whose leader
    has exited, so no terminal and no SSH hangup reaches it. Returns its pid once it has
    written its state (it says so through a pipe)."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # never returns into the caller's code
        code = 1
        try:
            os.close(read_end)
            os.setsid()
            if os.fork() == 0:
                _detach(log, keep=write_end)
                os.execv(sys.executable, [sys.executable, "-m", "skippy.mesh.supervisor",
                                          "--notify-fd", str(write_end), "--url", url,
                                          "--log", str(log), "--", *serve_args])
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as r:
        said = r.read().strip()
    if not said.isdigit():
        raise ServiceError(f"the service did not start: {_last_line(log)} (log: {log})")
    return int(said)


def _detach(log: Path, keep: int) -> None:
    """stdin from /dev/null, stdout and stderr to the log, every other descriptor (the
    SSH session's, were one inherited) closed but `keep`."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.fchmod(out, 0o600)  # private, as the supervisor's LogFile: it may quote requests
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    os.set_inheritable(keep, True)


def _wait_until_healthy(wait_s: float) -> ServiceState:
    deadline = time.monotonic() + wait_s
    while True:
        state = current()
        if state is None or state.phase == "failed":
            why = state.reason if state else "the supervisor is gone"
            raise ServiceError(f"the gateway did not start: {why}; {_last_line(log_path())} "
                               f"(log: {log_path()})")
        if state.phase == "running" and health(state.url) == "ok":
            return state
        if time.monotonic() > deadline:
            raise ServiceError(f"the gateway did not answer within {wait_s:g} s; it still "
                               f"starts (skippy status tells when it answers; log: "
                               f"{state.log})")
        time.sleep(0.5)


def _last_line(log: Path) -> str:
    """The gateway's last line in the log (the supervisor's own are left out)."""
    try:
        lines = [s for s in log.read_text(errors="replace").splitlines()
                 if s.strip() and SUPERVISOR_MARK not in s]
    except OSError:
        return "no log"
    return f"its log ends: {lines[-1].strip()[:300]}" if lines else "its log is empty"


# -- stop -------------------------------------------------------------------------------------
def stop(timeout_s: float = STOP_TIMEOUT_S) -> ServiceState | None:
    """Stop the service (the supervisor stops the gateway); the state it had, or None if
    none ran. After `timeout_s` both processes are killed."""
    state = current()
    if state is None:
        return None
    if state.phase != "failed":
        _signal(state.supervisor_pid, state.supervisor_start, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(state.supervisor_pid, state.supervisor_start) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        _signal(state.supervisor_pid, state.supervisor_start, signal.SIGKILL)
        _signal(state.gateway_pid, state.gateway_start, signal.SIGKILL)
    state_path().unlink(missing_ok=True)
    return state


def _signal(pid: int | None, start: int | None, sig: int) -> None:
    if alive(pid, start):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# -- status -----------------------------------------------------------------------------------
def describe(state: ServiceState, now: float | None = None) -> dict:
    """What `skippy status` reports."""
    now = time.time() if now is None else now
    up = now - state.gateway_started_at if state.gateway_started_at else None
    return {"phase": state.phase, "gateway_pid": state.gateway_pid,
            "supervisor_pid": state.supervisor_pid, "url": state.url,
            "uptime_s": round(up, 1) if up is not None else None,
            "service_uptime_s": round(now - state.started_at, 1),
            "restarts": state.restarts, "last_exit": state.last_exit,
            "log": state.log, "health": health(state.url) if state.phase == "running"
            else "no answer", "reason": state.reason, "serve_args": state.args}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    h, m = s // 3600, s // 60 % 60
    return f"{h}h{m:02d}m{s % 60:02d}s" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"
