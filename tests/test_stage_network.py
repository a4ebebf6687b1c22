"""The stage network as `skippy serve` builds it: a bad secret file is one line; mutual TLS
between Ray stages answers bitwise as plain TCP does and refuses plain TCP; and on a host
with an address besides loopback, `skippy serve` with defaults binds nothing but loopback —
its stages and its embedded Ray alike.

What embedded Ray binds, measured with `ss -ltnp` in a namespace whose default route
goes out through 10.77.0.1 (so Ray's own guess of the node address is 10.77.0.1):
  plain `ray.init` (and `_node_ip_address="127.0.0.1"`, which Ray turns back into the
  primary address): gcs_server, raylet (node manager, object manager), the driver's and
  every worker's core-worker server on `*` (all addresses), the autoscaler monitor's
  metrics on 0.0.0.0:44217, the runtime-env agent on 10.77.0.1;
  with Ray's cluster switch off while it starts (ray_engine.start_ray): every one of them
  on 127.0.0.1, nothing else listening (no dashboard, no metrics or dashboard agent port).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from skippy.mesh.stage import security
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc
from skippy_cli import skippy

pytestmark = pytest.mark.timeout(900)

PROMPT = [1] + [(i * 29) % 30000 + 50 for i in range(90)]
PRIVATE = "10.77.0.1"


@pytest.mark.parametrize("content, message", [(None, "cannot read"), ("\n", "is empty")])
def test_a_bad_cluster_secret_file_is_one_line_and_exit_code_2(tmp_path, content, message):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)  # only its owner may read it
    r = skippy("serve", "--model", "smollm2", "--cluster-secret-file", str(path))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr and str(path) in r.stderr


# -- Ray stages, TLS on and off ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_up():
    import ray

    from skippy.mesh.control.ray_engine import start_ray
    owned = start_ray()
    yield
    if owned:
        ray.shutdown()


SECRET = security.new_secret()


def engine(smollm2, tls: str):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.ray_engine import RayEngine
    return RayEngine(smollm2, 2, model_name="smollm2", cache=CacheConfig(), n_ctx=1024,
                     weight_format="int4", secret=SECRET, stage_tls=tls)


def answer(eng) -> list:
    from skippy.mesh.control.engine import GenerationRequest
    request = GenerationRequest(tuple(PROMPT), 8, logits=True)

    async def run():
        return [(s.token, s.logits.tolist()) async for s in eng.generate(request)]
    return asyncio.run(run())


def settled_stats(eng) -> list[dict]:
    deadline = time.monotonic() + 10
    while any(s["sessions"] for s in eng.stats()["stages"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return eng.stats()["stages"]


def call_code(channel: grpc.Channel, metadata=()) -> grpc.StatusCode:
    stub = stage_pb2_grpc.StageStub(channel)
    call = pb.StageCall(plan=pb.Plan(tokens=PROMPT, limit=len(PROMPT) - 1))
    with pytest.raises(grpc.RpcError) as e:
        next(stub.Session(iter([call]), metadata=metadata, timeout=60))
    return e.value.code()


@pytest.mark.slow
def test_tls_between_ray_stages_answers_bitwise_as_plain_tcp(ray_up, smollm2):
    plain = engine(smollm2, "off")
    try:
        assert not plain.stage_tls
        want = answer(plain)
        before = settled_stats(plain)
        for address in plain.pipelines[0].addresses:   # one node: loopback, no TLS
            assert address.startswith("127.0.0.1:")
            with grpc.insecure_channel(address) as channel:
                assert call_code(channel) == grpc.StatusCode.UNAUTHENTICATED
        assert settled_stats(plain) == before
    finally:
        asyncio.run(plain.close())
    tls = engine(smollm2, "on")
    try:
        assert tls.stage_tls
        assert answer(tls) == want
        before = settled_stats(tls)
        token = security.StageCredentials.plain(SECRET).metadata  # the right one, even
        for address in tls.pipelines[0].addresses:
            with grpc.insecure_channel(address) as channel:     # plain TCP to a TLS port
                assert call_code(channel, token) == grpc.StatusCode.UNAVAILABLE
        assert settled_stats(tls) == before
    finally:
        asyncio.run(tls.close())


# -- what `skippy serve` binds ----------------------------------------------------------------
# Inside a fresh network namespace: loopback and a private address that carries the
# default route, `skippy serve` with defaults, /ready, then every listening socket.
_SERVE_IN_NAMESPACE = r"""
set -u
ip link set lo up
ip link add d0 type dummy 2>/dev/null || ip link add d0 type bridge  # no dummy module here
ip addr add {private}/24 dev d0 && ip link set d0 up
ip route add default via 10.77.0.2 dev d0 onlink
setsid "$PY" -m skippy.mesh.cli serve --model smollm2 --stages 2 --port 8000 \
    > "$LOG" 2>&1 &
serve=$!
"$PY" - <<'EOF'
import time, urllib.request
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/ready", timeout=5)
        break
    except Exception:
        time.sleep(2)
EOF
ss -ltnp > "$SS"
ip -br addr > "$ADDR"
kill -INT "$serve"
for _ in $(seq 60); do kill -0 "$serve" 2>/dev/null || break; sleep 1; done
kill -KILL -- -"$serve" 2>/dev/null  # whatever of its process group is left
wait
exit 0
"""


def _namespaces_allowed() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("ss")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def listening(ss_output: str) -> list[str]:
    """Every listening socket's local address (`host:port`) in `ss -ltn` output."""
    return [line.split()[3] for line in ss_output.splitlines()[1:] if line.strip()]


@pytest.mark.slow
def test_serve_with_defaults_binds_only_loopback(smollm2, tmp_path):
    if not _namespaces_allowed():
        pytest.skip("no network namespaces here (`unshare -n` is not permitted)")
    files = {k: tmp_path / k for k in ("LOG", "SS", "ADDR")}
    script = _SERVE_IN_NAMESPACE.format(private=PRIVATE)
    subprocess.run(["unshare", "-n", "bash", "-c", script], timeout=840, check=True,
                   env={**os.environ, "PY": sys.executable,
                        **{k: str(v) for k, v in files.items()}})
    log, ss = files["LOG"].read_text(), files["SS"].read_text()
    assert PRIVATE in files["ADDR"].read_text()
    addresses = listening(ss)
    assert "127.0.0.1:8000" in addresses, f"never ready:\n{log}\n{ss}"
    assert len(addresses) >= 6, ss             # the gateway, 2 stages, Ray's own servers
    hosts = [a.rsplit(":", 1)[0] for a in addresses]
    wrong = [a for a, h in zip(addresses, hosts)
             if PRIVATE in h or h in ("0.0.0.0", "[::]", "*")]
    assert not wrong, ss
    assert all(h in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]") for h in hosts), ss


def test_stage_traffic_is_closed_wherever_another_host_could_join():
    """Decided for the cluster, not for the nodes at start: a head on a real address may
    gain a node later, and a stage moved there (a lost one's) must not talk in the clear
    or on that node's loopback."""
    from skippy.mesh.control.ray_engine import stage_network
    for alone in ("127.0.0.1:6379", "[::1]:6379", "localhost:6379"):  # the embedded Ray
        assert stage_network("auto", alone) == (False, "127.0.0.1")
    assert stage_network("on", "127.0.0.1:6379") == (True, "127.0.0.1")
    for head in ("10.0.0.5:6379", "head.example:6379", "[fd00::5]:6379"):
        assert stage_network("auto", head) == (True, None)  # each node's own address
    assert stage_network("off", "10.0.0.5:6379") == (False, None)


_TOKEN_HOLDER = """
import os, sys, ray
from skippy.mesh.control.ray_engine import start_ray
start_ray(num_cpus=1)
assert ray.get(ray.remote(lambda: 1).remote()) == 1  # its workers hold the token too
print(ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN_PATH"], flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_an_embedded_ray_takes_a_token_only_its_user_reads(tmp_path):
    """With no RAY_AUTH_MODE in the environment (a user's shell), the embedded Ray runs
    with token authentication, its token this serve's own in a 0600 file in a 0700
    folder, gone at exit; Ray's default (~/.ray/auth_token, 0644 under the usual umask)
    is never written."""
    from test_deploy import gcs_call
    ray_tmp = tempfile.mkdtemp(prefix="sk", dir="/tmp")  # Ray's socket paths: short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"HOME": str(tmp_path), "RAY_TMPDIR": ray_tmp}
    proc = subprocess.Popen([sys.executable, "-c", _TOKEN_HOLDER], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        address, path = proc.stdout.readline().split()
        token = Path(path)
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        assert gcs_call(address, token.read_text()) == "OK"
        assert gcs_call(address, None) == "UNAUTHENTICATED"
        assert not (tmp_path / ".ray").exists()
        if os.getuid() == 0:  # another local user can read no token to attach with
            denied = subprocess.run(["cat", path], user=54321, group=54321,
                                    capture_output=True, text=True)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not token.parent.exists()


def test_embedded_ray_ignores_a_stale_cluster_file():
    """A `ray start` cluster killed without `ray stop` leaves ray_current_cluster behind;
    a plain ray.init would try to join it (and refuse num_cpus). The embedded Ray starts
    its own whatever the file says."""
    tmp_path = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))  # Ray's socket paths: short
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    code = ("import ray; from skippy.mesh.control.ray_engine import start_ray; "
            "assert start_ray(num_cpus=1); print(ray.get_runtime_context().gcs_address); "
            "ray.shutdown()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "RAY_TMPDIR": str(tmp_path)})
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("127.0.0.1:") and r.stdout.strip() != "127.0.0.1:1"


@pytest.mark.parametrize("failure, starts", [
    ("The current node timed out during startup. This could happen because ...", 2),
    ("something else broke", 1)])
def test_an_embedded_ray_whose_raylet_is_late_starts_once_more(monkeypatch, failure, starts):
    """Ray waits a fixed 30 s for its raylet; a start that misses it is shut down and tried
    once more (a late raylet costs time, not the serve), and any other failure is raised."""
    import ray
    from skippy.mesh.control import ray_engine
    calls, shutdowns = [], []

    def init(**kw):
        calls.append(kw)
        if len(calls) == 1:
            raise Exception(failure)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    if starts == 1:
        with pytest.raises(Exception, match="something else"):
            ray_engine.start_ray(num_cpus=1)
    else:
        assert ray_engine.start_ray(num_cpus=1) is True
    assert len(calls) == starts and len(shutdowns) == starts - 1
    assert all(c["address"] == "local" and c["_node_ip_address"] == "127.0.0.1" for c in calls)
