"""The gateway as a service (mesh/service.py, mesh/supervisor.py), started as `ray up`
starts it: the YAML's own gateway command (deploy/cluster-local.yaml, `metadata.gateway`,
the last of head_start_ray_commands) run by bash against this test's Ray cluster. The
test's values come in as the head's do: $HOME (the venv, the Ray token, the API key file
the command names under ~), $SKIPPY_HOME (the models) and RAY_ADDRESS (what
`--address auto` joins; on a head, `ray start` leaves its address where `auto` finds it).

Starts Ray and a server: run in the loopback-only namespace (DESIGN.md §9)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from skippy.mesh.cli import main
from skippy.mesh.service import (ServiceState, alive, current, describe, duration, probe_url,
                                  process_start, stop)
from skippy.mesh.supervisor import LogFile, RestartPolicy
from skippy_cli import skippy

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]


# -- the restart policy, and what status makes of a state -----------------------------------------
def test_short_runs_back_off_then_give_up():
    policy = RestartPolicy()
    assert [policy.after_exit(1, 3.0) for _ in range(5)] == [1, 2, 4, 8, None]
    assert "5 times in a row" in policy.why_not(1)


def test_a_run_that_lasted_starts_the_backoff_over():
    policy = RestartPolicy()
    assert [policy.after_exit(-9, 1.0) for _ in range(3)] == [1, 2, 4]
    assert policy.after_exit(-9, 3600.0) == 1
    assert policy.after_exit(1, 2.0) == 1


def test_refused_options_are_not_retried():
    policy = RestartPolicy()
    assert policy.after_exit(2, 3600.0) is None
    assert "refused its options" in policy.why_not(2)


def test_a_gateway_whose_cluster_went_is_not_restarted():
    from skippy.mesh.control.cluster_watch import EXIT_CLUSTER_GONE
    policy = RestartPolicy()
    assert policy.after_exit(EXIT_CLUSTER_GONE, 3600.0) is None
    assert "ray down" in policy.why_not(EXIT_CLUSTER_GONE)


def test_the_cluster_watch_sees_its_gcs_go():
    """A port that answers, then one that refuses: gone after MISSES refused connects."""
    import socket
    import threading
    from skippy.mesh.control.cluster_watch import MISSES, watch
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    gone, said = threading.Event(), []
    watch(address, said.append, gone.set, check_s=0.05)
    assert not gone.wait(0.3)  # it answers: watched on
    server.close()
    assert gone.wait(0.05 * (MISSES + 10)) and "is gone" in said[0]


def test_a_workers_watcher_stops_its_ray_when_the_head_goes(tmp_path):
    """The worker's watcher (deploy/cluster-local.yaml): an earlier watcher ends, the new
    one runs `ray stop` once the head's GCS refuses connects, not before."""
    import socket
    import subprocess
    import sys
    import threading
    from skippy.mesh.control.cluster_watch import stop_ray_when_gone
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "cluster_watch"])
    pid_file = tmp_path / "node-watch.pid"
    pid_file.write_text(str(earlier.pid))
    ray = tmp_path / "ray"
    ray.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/stopped\n")
    ray.chmod(0o755)
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    codes = []
    watcher = threading.Thread(
        target=lambda: codes.append(stop_ray_when_gone(address, pid_file, str(ray), 0.05)))
    watcher.start()
    assert earlier.wait(10) == -15  # ended by the new watcher
    assert pid_file.read_text() == str(os.getpid())
    watcher.join(0.5)
    assert watcher.is_alive() and not (tmp_path / "stopped").exists()  # its GCS answers
    server.close()
    watcher.join(10)
    assert codes == [0] and (tmp_path / "stopped").read_text() == "stop\n"


def test_the_log_moves_aside_past_its_cap(tmp_path):
    log = LogFile(tmp_path / "gateway.log", max_bytes=1000)
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(b"".join(b"line %04d of the gateway\n" % i for i in range(100)))
    with os.fdopen(read, "rb") as r:
        log.pump(r)
    log.say("stopped")
    old = (tmp_path / "gateway.log.1").read_bytes()
    new = (tmp_path / "gateway.log").read_bytes()
    assert len(old) >= 1000 and len(new) < 1000 + 100
    assert new.endswith(b" skippy service: stopped\n")
    assert b"line 0099 of the gateway\n" in new
    # private, both the log and the one moved aside
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {0o600}


def test_the_log_is_private_and_never_followed_through_a_symlink(tmp_path):
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"")
    decoy.chmod(0o644)
    (tmp_path / "gateway.log").symlink_to(decoy)
    with pytest.raises(OSError):
        LogFile(tmp_path / "gateway.log")
    assert decoy.read_bytes() == b"" and stat.S_IMODE(decoy.stat().st_mode) == 0o644
    (tmp_path / "gateway.log").unlink()
    (tmp_path / "gateway.log").write_bytes(b"an older version's log\n")
    (tmp_path / "gateway.log").chmod(0o644)
    LogFile(tmp_path / "gateway.log").say("started")
    assert stat.S_IMODE((tmp_path / "gateway.log").stat().st_mode) == 0o600


def test_alive_means_running_and_the_same_process():
    child = subprocess.Popen(["sleep", "30"])
    try:
        start = process_start(child.pid)
        assert alive(child.pid, start) and not alive(child.pid, start + 1)  # a reused pid
    finally:
        child.kill()
    wait_for(lambda: process_start(child.pid) is None, 10, step=0.05)  # a zombie: gone
    assert not alive(child.pid, start)
    child.wait()


def test_status_figures():
    state = ServiceState(supervisor_pid=1, url="http://0.0.0.0:9", log="/x.log", args=[],
                         started_at=1000.0, gateway_pid=2, gateway_started_at=1100.0,
                         restarts=1, phase="restarting", last_exit=-9)
    d = describe(state, now=1200.0)
    assert (d["uptime_s"], d["service_uptime_s"], d["restarts"]) == (100.0, 200.0, 1)
    assert d["health"] == "no answer"  # not asked while it restarts
    assert [duration(s) for s in (5, 65, 3725, None)] == ["5s", "1m05s", "1h02m05s", "-"]
    assert probe_url("http://0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert probe_url("http://10.0.0.2:8000") == "http://10.0.0.2:8000"


# -- the CLI, no Ray -------------------------------------------------------------------------------
def make_home(tmp_path: Path, smollm2: Path) -> Path:
    """A head's home as the YAMLs set it up: ~/skippy-venv (this interpreter's venv), the
    Ray token, the API and operator keys, and SKIPPY_HOME with this machine's models (and compiled
    kernels, so that none is built again)."""
    from skippy.mesh.models import model_home
    (tmp_path / "skippy-venv").symlink_to(Path(sys.executable).parents[1])
    auth = tmp_path / "skippy-ray-auth"
    auth.mkdir(mode=0o700)
    (auth / "token").write_text(secrets.token_hex(32) + "\n")
    for keys in ("skippy-api-keys", "skippy-operator-keys"):
        (tmp_path / keys).write_text(secrets.token_urlsafe(32) + "\n")
        (tmp_path / keys).chmod(0o600)  # only its owner may read it
    skippy_home = tmp_path / "skippy-home"
    skippy_home.mkdir()
    (skippy_home / "models").symlink_to(Path(smollm2).parent)
    if (model_home() / "kernels").is_dir():
        (skippy_home / "kernels").symlink_to(model_home() / "kernels")
    return tmp_path


@pytest.fixture
def home(tmp_path, smollm2):
    return make_home(tmp_path, smollm2)


def env_of(home: Path, **more: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return base | {"HOME": str(home), "SKIPPY_HOME": str(home / "skippy-home")} | more


@contextlib.contextmanager
def skippy_home(env: dict):
    """mesh.service's functions, called here, on the service of `env`."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SKIPPY_HOME", env["SKIPPY_HOME"])
        yield


def run_cli(env: dict, capsys, *args: str) -> tuple[int, str, str]:
    """`skippy ARGS` in this process (main(), as the console script calls it)."""
    with skippy_home(env):
        code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_options_serve_refuses_are_not_restarted(home, capsys):
    env = env_of(home)
    r = skippy("service", "start", "--wait", "60", "--", "--stages", "0", "--port", "1",
               env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "refused its options (exit code 2)" in r.stderr
    assert "--stages must be at least 1, not 0" in r.stderr  # the log's last line
    code, out, _ = run_cli(env, capsys, "status")
    assert code == 1 and "gave up: skippy serve refused its options" in out, out
    assert run_cli(env, capsys, "service", "stop")[0] == 0
    assert "no gateway service runs" in run_cli(env, capsys, "status")[1]


def test_mistakes_are_one_line_before_anything_starts(home, capsys):
    env = env_of(home)
    for args, says in ((["--host", "0.0.0.0"], "without API keys"),
                       (["--model", "no-such-model"], "no such model"),
                       (["--no-such-flag"], "unrecognized arguments")):
        code, _, err = run_cli(env, capsys, "service", "start", "--", *args)
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert not (home / "skippy-home" / "service" / "state.json").exists()
    code, _, err = run_cli(env, capsys, "service", "restart")
    assert code == 2 and "no gateway service to restart" in err


def test_a_stale_state_is_not_a_running_service(home, capsys):
    env = env_of(home)
    folder = home / "skippy-home" / "service"
    folder.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = ServiceState(supervisor_pid=dead.pid, supervisor_start=1, url="http://x:1",
                         log="/x", args=[], started_at=0.0, phase="running")
    (folder / "state.json").write_text(json.dumps(state.__dict__))
    code, out, _ = run_cli(env, capsys, "status")
    assert code == 1 and "no gateway service runs" in out
    assert not (folder / "state.json").exists()


# -- the YAML's gateway command against a Ray cluster ---------------------------------------------
_CLUSTER = """
import sys
from ray.cluster_utils import Cluster
names = iter("abcdefgh")

def node():
    return {"num_cpus": 1, "resources": {f"skippy_node_{next(names)}": 1},
            "object_store_memory": 100 * 2**20}

c = Cluster(initialize_head=True, connect=False,
            head_node_args={**node(), "include_dashboard": False})
c.add_node(**node())
c.wait_for_nodes()
print(c.address, flush=True)
for line in sys.stdin:  # a line: one more node
    c.add_node(**node())
    c.wait_for_nodes()
    print("added", flush=True)
c.shutdown()  # stdin closed: stop what this process started
"""


def gateway_command(name: str = "cluster-local.yaml") -> str:
    config = yaml.safe_load((REPO / "deploy" / name).read_text())
    return config["metadata"]["gateway"]


class Head:
    """The test's Ray cluster: a head and one worker, a third node on request, in a
    process of its own (token auth on, as the YAMLs run it) that stops them when its
    stdin closes."""

    def __init__(self, home: Path):
        self.tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # socket paths <= 107 bytes
        env = env_of(home, RAY_TMPDIR=self.tmp, RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN_PATH=str(home / "skippy-ray-auth" / "token"))
        self.proc = subprocess.Popen([sys.executable, "-c", _CLUSTER], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.address = self.proc.stdout.readline().strip()
        assert self.address, "the test's Ray did not start"

    def add_node(self) -> None:
        self.proc.stdin.write("add\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "added"

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_for(what, timeout: float, step: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"not within {timeout} s: {what}")


class Service:
    def __init__(self, home: Path, env: dict, shell: subprocess.Popen, out: str, err: str):
        self.home, self.env, self.shell, self.out, self.err = home, env, shell, out, err
        self.key = (home / "skippy-api-keys").read_text().strip()
        self.operator_key = (home / "skippy-operator-keys").read_text().strip()
        self.log = home / "skippy-home" / "service" / "gateway.log"
        self.url = "http://127.0.0.1:8000"

    def status(self) -> dict | None:
        """What `skippy status --json` prints, read in this process."""
        with skippy_home(self.env):
            state = current()
            return describe(state) if state else None

    def call(self, path: str, body: dict | None = None, key: str | None = "") -> tuple:
        key = self.key if key == "" else key
        headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {key}"} if key else {})
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def chat(self, content: str, **kw) -> tuple:
        return self.call("/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **kw})


@pytest.fixture(scope="module")
def service(tmp_path_factory, smollm2):
    """The YAML's gateway command, run by bash in a session of its own, while the test's
    cluster has 2 of the 3 nodes the command waits for; the third joins once the log
    says it waits. Yields once the shell has exited (the command returns when the gateway
    answers, `--wait`)."""
    home = make_home(tmp_path_factory.mktemp("head"), smollm2)
    head = Head(home)
    env = env_of(home, RAY_ADDRESS=head.address, RAY_TMPDIR=head.tmp)
    log = home / "skippy-home" / "service" / "gateway.log"
    shell = subprocess.Popen(["bash", "-c", gateway_command()], env=env, cwd=home,
                             start_new_session=True, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: shell.poll() is not None or (
            log.exists() and "waiting for 3 Ray nodes (2 joined)" in log.read_text()), 120)
        head.add_node()
        # reads both pipes to their end: a service holding either would time out here
        out, err = shell.communicate(timeout=300)
        yield Service(home, env, shell, out, err)
    finally:
        shell.kill()
        with skippy_home(env):
            stop()
        head.close()


def test_the_yaml_starts_a_gateway_that_outlives_its_shell(service):
    assert service.shell.returncode == 0, service.err + service.log.read_text()
    assert "answers at http://0.0.0.0:8000/v1" in service.err
    with pytest.raises(ProcessLookupError):  # nothing is left in the shell's session
        os.killpg(service.shell.pid, signal.SIGKILL)
    status, body = service.chat("What is the capital of France?")
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"]
    assert service.call("/v1/models", key=None)[0] == 401  # the YAML's key file holds
    log = service.log.read_text()
    assert "waiting for 3 Ray nodes (2 joined)" in log and "3 Ray nodes joined" in log


# -- the Grafana dashboard ------------------------------------------------------------------------
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
METRIC = re.compile(r"\bskippy_\w+")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel, rows' own panels included."""
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"] + [p for r in board["panels"] for p in r.get("panels", [])]
    assert all(p.get("targets") for p in panels if p["type"] != "row")
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def exported_names(text: str) -> set[str]:
    """Every sample name a scrape holds, as prometheus_client's own parser reads it
    (histograms as _bucket/_sum/_count, counters as _total)."""
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_every_dashboard_panel_queries_a_skippy_metric():
    queries = dashboard_queries()
    assert len(queries) >= 30
    for title, expr in queries:
        assert METRIC.search(expr), f"panel {title!r} names no skippy metric: {expr}"
    named = set(METRIC.findall(DASHBOARD.read_text()))
    for needed in ("skippy_requests_total", "skippy_time_to_first_token_seconds_bucket",
                   "skippy_decode_tokens_per_second_bucket", "skippy_tokens_generated_total",
                   "skippy_gateway_requests_running", "skippy_gateway_requests_waiting",
                   "skippy_gateway_requests_refused_total", "skippy_stage_cache_hits_total",
                   "skippy_stage_cache_misses_total",
                   "skippy_stage_block_store_physical_bytes"):
        assert needed in named, needed


def test_the_dashboard_names_only_metrics_the_gateway_exports(service):
    """Every name anywhere in the dashboard (panels, the job variable's query) is a sample
    of a live scrape of the gateway `ray up` starts, after requests of each kind."""
    for _ in range(2):  # the same twice: the second is an exact-result hit
        assert service.chat("Name a color.")[0] == 200
    assert service.chat("Name a color. And a fruit.", temperature=0.7, seed=1)[0] == 200
    assert service.chat("Hi", max_tokens=-1)[0] == 400  # an error, counted by status
    assert service.call("/metrics")[0] == 403  # a client's key: the YAML's operator key holds
    status, text = service.call("/metrics", key=service.operator_key)
    assert status == 200
    exported = exported_names(text)
    missing = sorted(set(METRIC.findall(DASHBOARD.read_text())) - exported)
    assert not missing, f"not in /metrics: {missing}\nexported: {sorted(exported)}"


def prometheus_binary() -> str | None:
    return os.environ.get("SKIPPY_PROMETHEUS") or shutil.which("prometheus")


@pytest.mark.skipif(not prometheus_binary(), reason="no prometheus binary (Debian's "
                    "`prometheus` package, or SKIPPY_PROMETHEUS=PATH)")
def test_every_dashboard_query_has_data_in_prometheus(service, tmp_path):
    """A real Prometheus scrapes the gateway (with the operator's key, as deploy/README.md
    says) while requests run; then every query of every panel, as Grafana would send it, returns
    series: the PromQL parses, and its names, labels and functions fit the data."""
    key = tmp_path / "key"
    key.write_text(service.operator_key)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "skippy",
                            "authorization": {"credentials_file": str(key)},
                            "static_configs": [{"targets": ["127.0.0.1:8000"]}]}]}))
    api = f"http://127.0.0.1:{port}/api/v1/query?"

    def query(expr: str) -> list:
        with urllib.request.urlopen(api + urllib.parse.urlencode({"query": expr}),
                                    timeout=10) as r:
            return json.loads(r.read())["data"]["result"]

    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen([prometheus_binary(),
                                 f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        scrapes = 'count_over_time(up{job="skippy"}[1m])'
        end = time.monotonic() + 60
        while time.monotonic() < end and not (
                _answers(query, scrapes) and float(query(scrapes)[0]["value"][1]) >= 4):
            service.chat("Name a color.")
            service.chat("Hi", max_tokens=-1)
        empty = []
        for title, expr in dashboard_queries():
            grafana = expr.replace("$__rate_interval", "10s").replace("$job", ".*")
            if not query(grafana):
                empty.append((title, grafana))
        assert not empty, (tmp_path / "prometheus.log").read_text()[-2000:] + str(empty)
    finally:
        prom.kill()
        prom.wait()


def _answers(query, expr: str) -> bool:
    try:
        return bool(query(expr))
    except OSError:  # not listening yet
        return False


# -- restart, status, stop ------------------------------------------------------------------------
def test_a_killed_gateway_comes_back(service):
    before = service.status()
    assert before["phase"] == "running" and before["health"] == "ok", before
    os.kill(before["gateway_pid"], signal.SIGKILL)
    after = wait_for(lambda: (s := service.status()) and s["gateway_pid"] != before[
        "gateway_pid"] and s["health"] == "ok" and s, 240, step=1)
    assert after["restarts"] == before["restarts"] + 1 and after["last_exit"] == -9
    assert after["supervisor_pid"] == before["supervisor_pid"]
    assert service.chat("What is 2 + 2?")[0] == 200
    assert "exited (code -9)" in service.log.read_text()


def test_status_says_pid_url_uptime_and_log(service):
    s = service.status()
    r = skippy("status", env=service.env, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["gateway"] == "running, /health: ok"
    assert rows["pid"].startswith(f"{s['gateway_pid']} (supervisor {s['supervisor_pid']})")
    assert rows["url"] == "http://0.0.0.0:8000/v1"
    assert re.fullmatch(r"(\d+h)?(\d+m)?\d+s \(service (\d+h)?(\d+m)?\d+s\)", rows["uptime"])
    assert rows["log"] == str(service.log) and rows["restarts"].startswith(str(s["restarts"]))


def test_stop_ends_the_gateway_and_its_supervisor(service):
    s = service.status()
    r = skippy("service", "stop", env=service.env, timeout=120)
    assert r.returncode == 0 and f"gateway stopped (pid {s['gateway_pid']})" in r.stderr
    for pid in (s["gateway_pid"], s["supervisor_pid"]):
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert service.status() is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(service.url + "/health", timeout=5)
