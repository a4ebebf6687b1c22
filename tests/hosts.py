"""Hosts that really are separate, on one machine (DESIGN.md §9): each host is a network
namespace with a private address of its own on a bridge, its own Ray node, its own
`SKIPPY_HOME`, `HOME` and Ray temp dir under a root no other host can see, so hosts share
no address, socket or file (but the repository, the venv and files outside the hosts'
roots, such as the models the fixtures pulled, read by absolute path). The test process
sits on the bridge too and reaches every host over the network, as a client would.

Needs root, veth and bridge links, and a loopback-only namespace to start in
(`unshare -n`, as `make test` runs), so the addresses exist nowhere else; skips, saying
why, where any is missing. Teardown stops every process inside the hosts (by pid: never
`ray stop`, which would stop every Ray on the machine) and removes the namespaces, links
and bridge, whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.88.0"
BRIDGE = "skbr0"               # lives in the test's own namespace, which no one else sees
BRIDGE_IP = f"{SUBNET}.254"    # the test process's address on the bridge
RAY_PORT = 6379
BIN = Path(sys.executable).parent
MiB = 2**20


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str
    root: Path   # everything this host writes: SKIPPY_HOME, HOME, Ray's temp dir, logs
    others: tuple[Path, ...] = ()  # the other hosts' roots, which this host cannot see

    @property
    def env(self) -> dict[str, str]:
        home = self.root / "home"
        return {**os.environ, "HOME": str(home), "SKIPPY_HOME": str(home / "skippy"),
                "TMPDIR": str(self.root / "tmp"), "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` inside this host. `ip netns exec` runs it in a mount namespace of its
        own, where an empty tmpfs covers each other host's root: a host that reads
        another's files (a model pulled there, a cache) fails as it would on a real one."""
        hide = " ".join(f'mount -t tmpfs -o size=1m skippy-other-host "{d}" &&'
                        for d in self.others)
        return ["ip", "netns", "exec", self.netns, "sh", "-c", f'{hide} exec "$@"', "sh", *cmd]

    def run(self, *cmd: str, input: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `cmd` inside this host and wait; raises with its output if it fails."""
        done = subprocess.run(self.argv(*cmd), env=self.env, capture_output=True, text=True,
                              input=input, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{self.netns}: {' '.join(cmd)} failed ({done.returncode}):\n"
                               f"{done.stdout}\n{done.stderr}")
        return done

    def start(self, *cmd: str, log: str) -> subprocess.Popen:
        """Start `cmd` inside this host in the background, output to root/log."""
        out = open(self.root / log, "w")
        return subprocess.Popen(self.argv(*cmd), env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> list[int]:
        """Every process in this host's namespace: only ones this harness started."""
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                              text=True)
        return [int(p) for p in done.stdout.split()]

    def listening(self) -> list[tuple[str, str]]:
        """(local address, process name) of each listening TCP socket in this host."""
        rows = []
        for line in self.run("ss", "-Htlnp").stdout.splitlines():
            fields = line.split()
            name = fields[-1].split('"')[1] if '"' in fields[-1] else ""
            rows.append((_ipv4(fields[3]), name))
        return rows

    def peers(self) -> set[str]:
        """Remote addresses of this host's established TCP connections."""
        out = self.run("ss", "-Htn", "state", "established").stdout
        return {_ipv4(line.split()[3]) for line in out.splitlines()}


def _ipv4(address: str) -> str:
    """ss's "[::ffff:10.88.0.1]:port" (a dual-stack socket) as "10.88.0.1:port"."""
    return address.replace("[::ffff:", "").replace("]", "")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def check_allowed() -> None:
    """Skip, saying why, unless this process may make private hosts here."""
    if os.geteuid() != 0:
        pytest.skip("separate hosts need root (network namespaces, veth, bridge)")
    if _links_besides_lo():
        # the bridge's address must exist only in a namespace the test made
        pytest.skip("separate hosts run only in a loopback-only namespace (unshare -n)")
    probe = f"skprobe{os.getpid()}"
    tried = [_ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b"),
             _ip("link", "add", f"{probe}c", "type", "bridge"),
             _ip("netns", "add", probe)]
    for link in ("a", "c"):
        _ip("link", "del", f"{probe}{link}")
    _ip("netns", "del", probe)
    for done in tried:
        if done.returncode:
            pytest.skip(f"cannot make separate hosts here: {' '.join(done.args)}: "
                        f"{done.stderr.strip()}")


def _wire(hosts: Sequence[Host]) -> None:
    """The bridge, with our address, and one veth pair per host into its namespace."""
    steps = [["link", "add", BRIDGE, "type", "bridge"],
             ["addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE],
             ["link", "set", BRIDGE, "up"]]
    for i, h in enumerate(hosts, 1):
        outer = f"skv{i}"
        steps += [["netns", "add", h.netns],
                  ["link", "add", outer, "type", "veth", "peer", "name", "eth0",
                   "netns", h.netns],
                  ["link", "set", outer, "master", BRIDGE],
                  ["link", "set", outer, "up"],
                  ["-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0"],
                  ["-n", h.netns, "link", "set", "eth0", "up"],
                  ["-n", h.netns, "link", "set", "lo", "up"]]
    for step in steps:
        done = _ip(*step)
        if done.returncode:
            raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")


def _unwire(hosts: Sequence[Host]) -> None:
    """Stop every process in the hosts (TERM, then KILL), then remove the links."""
    # Ray's daemons can take more than 8 s to end on TERM (each waits on the others)
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        for h in hosts:
            for pid in h.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while any(h.pids() for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
    for i, h in enumerate(hosts, 1):
        # our end of the pair first: a namespace something still holds would keep it
        _ip("link", "del", f"skv{i}")
        _ip("netns", "del", h.netns)
    _ip("link", "del", BRIDGE)
    # The kernel removes a deleted namespace's veth pairs a moment later: wait, so that the
    # next module's hosts find a loopback-only namespace again (check_allowed).
    deadline = time.monotonic() + 10
    while _links_besides_lo() and time.monotonic() < deadline:
        time.sleep(0.1)


def _links_besides_lo() -> bool:
    links = _ip("-o", "link", "show").stdout.split("\n")
    return any(line and ": lo:" not in line for line in links)


# The GCS declares a silent node dead after 3 missed health checks a second apart (Ray's
# defaults: 5 missed, 3 s apart, after a 10 s timeout: ~20 s of a test spent waiting).
NODE_DEATH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
              "health_check_failure_threshold": 3}


def _start_ray(hosts: Sequence[Host], memory: Sequence[int], num_cpus: int) -> None:
    """A head on the first host, a worker on each other, each with its own temp dir.
    `memory`: each node's Ray memory resource, which the planner places stages by."""
    head = f"{hosts[0].ip}:{RAY_PORT}"
    for i, (h, mem) in enumerate(zip(hosts, memory)):
        role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                f"--system-config={json.dumps(NODE_DEATH)}"] if i == 0 \
            else [f"--address={head}"]
        _ray_start(h, role, mem, num_cpus, h.root / "ray")
    _wait_for_nodes(head, len(hosts))


def _ray_start(host: Host, role: list[str], memory: int, num_cpus: int, temp: Path) -> None:
    host.run(str(BIN / "ray"), "start", *role, f"--node-ip-address={host.ip}",
             f"--num-cpus={num_cpus}", f"--memory={memory}",
             f"--object-store-memory={100 * MiB}", f"--temp-dir={temp}",
             "--disable-usage-stats")


def leave_ray(host: Host, head: Host, timeout: float = 60) -> None:
    """`host` leaves the cluster as a machine shut down does: its processes get TERM (the
    raylet tells the GCS it goes), then KILL; returns once the head no longer lists it."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
    deadline = time.monotonic() + timeout
    while host.ip in ray_nodes(f"{head.ip}:{RAY_PORT}"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host.ip} is still a Ray node {timeout} s after it stopped")
        time.sleep(0.2)


def join_ray(host: Host, head: Host, memory: int, *, num_cpus: int = 1) -> str:
    """`host` (again) joins the cluster at `head` as a new node, with a fresh temp dir;
    returns its node id."""
    # a short name: Ray's socket paths under it must fit 107 bytes
    temp = host.root / f"rj{sum(1 for _ in host.root.glob('rj*'))}"
    temp.mkdir()
    _ray_start(host, [f"--address={head.ip}:{RAY_PORT}"], memory, num_cpus, temp)
    deadline = time.monotonic() + 60
    while host.ip not in (nodes := ray_nodes(f"{head.ip}:{RAY_PORT}")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host.ip} did not join the cluster")
        time.sleep(0.2)
    return nodes[host.ip]


def kill_host(host: Host) -> None:
    """Every process in `host`, SIGKILL, as a machine that loses power (never `ray stop`)."""
    deadline = time.monotonic() + 10
    while pids := host.pids():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host.netns}: processes {pids} outlived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def stage_address(host: Host) -> str:
    """The address the stage server on `host` listens on: its actor's one socket bound to
    an address (the actor's other, on `*`, is Ray's core-worker server; see
    tests/test_stage_network.py)."""
    found = [addr for addr, name in host.listening()
             if name == "ray::StageActor" and not addr.startswith("*")]
    assert len(found) == 1, host.listening()
    return found[0]


# Run inside a host: reach a stage's port over TCP, then call it over gRPC with the cluster
# secret's token, in the clear and over TLS under another CA.
_PROBE = """
import json, socket, sys, grpc
from skippy.mesh.stage.security import ClusterCredentials, StageCredentials
from skippy.proto import stage_pb2 as pb, stage_pb2_grpc
address, secret = sys.argv[1], sys.stdin.read().strip()
host, port = address.rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=10).close()
token = StageCredentials.plain(secret).metadata
def code(channel):
    try:
        with channel:
            list(stage_pb2_grpc.StageStub(channel).GetBlocks(
                pb.BlockRequest(), metadata=token, timeout=20))
        return "OK"
    except grpc.RpcError as e:
        return e.code().name
print(json.dumps({"plain": code(grpc.insecure_channel(address)),
                  "other_ca": code(ClusterCredentials(secret, tls=True).issue()
                                   .channel(address, []))}))
"""


def probe_stage(host: Host, address: str, secret: str) -> dict[str, str]:
    """From inside `host`, the gRPC status of a call to the stage at `address` in the clear
    and under another CA, both with `secret`'s token ("UNAVAILABLE" both: the stage speaks
    TLS and trusts only its cluster's CA; a plain stage would answer the first)."""
    done = host.run(sys.executable, "-c", _PROBE, address, input=secret)
    return json.loads(done.stdout)


def ray_nodes(head: str) -> dict[str, str]:
    """Alive Ray nodes as {node address: node id}, asked of the head's GCS over the bridge."""
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2
    infos = GcsClient(address=head).get_all_node_info(timeout=10).values()
    return {i.node_manager_address: i.node_id.hex() for i in infos
            if i.state == gcs_pb2.GcsNodeInfo.ALIVE}


def _wait_for_nodes(head: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(ray_nodes(head)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ray_nodes(head))} of {n} Ray nodes joined")
        time.sleep(0.5)


@contextlib.contextmanager
def separate_hosts(root: Path, memory: Sequence[int], *,
                   num_cpus: int = 1) -> Iterator[list[Host]]:
    """One host per entry of `memory` (its Ray memory resource, in bytes), at
    10.88.0.1, .2, ...; Ray's head on the first. Everything is gone after the block."""
    check_allowed()
    tag = f"sk{os.getpid()}"   # namespace names are machine-wide: ours carry our pid
    roots = [root / f"h{i}" for i in range(1, len(memory) + 1)]
    hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i}", r, tuple(o for o in roots if o != r))
             for i, r in enumerate(roots, 1)]
    for h in hosts:
        for sub in ("home/skippy", "tmp", "ray"):
            (h.root / sub).mkdir(parents=True, exist_ok=True)
    try:
        _wire(hosts)
        _start_ray(hosts, memory, num_cpus)
        yield hosts
    finally:
        _unwire(hosts)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Wait until `url` answers (any HTTP status); fail with the log if `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} never answered (exit {proc.poll()}):\n"
                               f"{log.read_text()[-4000:]}")
        time.sleep(1)


def greedy_chat(url: str, model: Path, ranges: Sequence[tuple[int, int]], question: str, *,
                n_ctx: int, max_tokens: int = 16) -> tuple[str, list[int], object]:
    """Ask the gateway at `url` (its model named "smollm2") `question`, greedy, and compute
    the answer the in-process pipeline gives on `model` with the same `ranges` (int4
    weights, cache off): (the served text, the in-process token ids, the tokenizer)."""
    import openai
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.chat import render_chat
    from skippy.mesh.tokenizer import Tokenizer
    messages = [{"role": "user", "content": question}]
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
    got = client.chat.completions.create(model="smollm2", messages=messages,
                                         max_tokens=max_tokens, temperature=0)
    tok = Tokenizer(model)
    local = InProcessEngine(model, ranges=list(ranges), n_ctx=n_ctx, weight_format="int4",
                            cache=CacheConfig(enabled=False))
    want = [s.token for s in local.complete(tok.encode(render_chat(model, messages)),
                                            max_tokens, stop_ids=frozenset(tok.eog_ids))]
    return got.choices[0].message.content, want, tok


GiB = 2**30
# Ray memory of the three hosts the `hosts` fixture makes (tests/conftest.py). The planner
# ranks nodes by memory, stage 0 on the largest: decreasing memories put stage i on host
# i. Ray's memory resource is a number it schedules by, not a limit.
MEMORY = (int(3.0 * GiB), int(2.9 * GiB), int(2.8 * GiB))

STAGE_LINE = re.compile(r"stage (\d+): layers (\d+)-(\d+) on node (\w+)")


@contextlib.contextmanager
def serving(head: Host, port: int, *args: str, log: str = "serve.log") -> Iterator[Path]:
    """`skippy serve ARGS` inside `head`: the model named "smollm2", Ray at the head, the
    gateway on the head's address. Yields its log's path once the gateway answers, and
    ends it after (the driver's end takes its stage actors with it)."""
    proc = head.start(str(BIN / "skippy"), "serve", *args, "--model-name", "smollm2",
                      "--address", f"{head.ip}:{RAY_PORT}", "--host", head.ip,
                      "--port", str(port), "--insecure", log=log)
    path = head.root / log
    try:
        wait_http(f"http://{head.ip}:{port}/v1/models", proc, path)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)


def planned(serve_log: str) -> list[tuple[int, int, str]]:
    """(start, end, node id prefix) of each stage, from the serve log's plan lines."""
    rows = sorted({(int(i), int(a), int(b) + 1, node) for i, a, b, node
                   in STAGE_LINE.findall(serve_log)})
    assert [r[0] for r in rows] == list(range(len(rows))), serve_log
    return [r[1:] for r in rows]


class Streams:
    """Greedy chat streams, one thread each, to the gateway at `base`: their text so far
    (`got`), content chunks (`chunks`) and failures (`errors`)."""

    def __init__(self, base: str, questions: Sequence[str], max_tokens: int,
                 salt: str | None = None):
        """`salt`: the requests' cache_salt (a namespace of their own: nothing of earlier
        requests' serves them, the gateway's exact results included)."""
        import openai
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                    timeout=300)
        self.questions, self.max_tokens = list(questions), max_tokens
        self.extra = {"cache_salt": salt} if salt else None
        self.got, self.chunks = [""] * len(questions), [0] * len(questions)
        self.errors: list[BaseException] = []
        self.runs = [threading.Thread(target=self._stream, args=(i,))
                     for i in range(len(questions))]

    def _stream(self, i: int) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": self.questions[i]}],
                    max_tokens=self.max_tokens, temperature=0, stream=True,
                    extra_body=self.extra):
                if chunk.choices and chunk.choices[0].delta.content:
                    self.got[i] += chunk.choices[0].delta.content
                    self.chunks[i] += 1
        except BaseException as e:  # noqa: BLE001 - told by the main thread
            self.errors.append(e)

    def start(self, chunks: int, timeout: float = 120) -> None:
        """Start them all; return once each has sent `chunks` content chunks."""
        for r in self.runs:
            r.start()
        deadline = time.monotonic() + timeout
        while min(self.chunks) < chunks and not self.errors:
            assert time.monotonic() < deadline, self.chunks
            time.sleep(0.01)

    def join(self, timeout: float = 240) -> None:
        for r in self.runs:
            r.join(timeout)
