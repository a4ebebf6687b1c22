"""The cluster YAMLs pass Ray's own launcher checks (`ray up` minus the SSH and the cloud).

prepare_config fills in the provider's defaults and node types exactly as `ray up` does,
and validate_config checks the result against Ray's schema. Neither touches the network:
the AWS provider's bootstrap (boto3, key pairs, security groups) is a later step that
these checks do not reach, so no cloud client is needed.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
YAMLS = ["cluster-local.yaml", "cluster-aws.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", YAMLS)
def test_ray_accepts_the_cluster_yaml(name):
    config = prepare_config(load(name))
    validate_config(config)
    assert config["cluster_name"] == "skippy"


def test_local_cluster_names_head_and_workers():
    raw = load("cluster-local.yaml")
    assert raw["provider"]["head_ip"] == "HEAD_IP"
    assert len(raw["provider"]["worker_ips"]) == 2
    config = prepare_config(raw)
    node_type = config["available_node_types"][config["head_node_type"]]
    assert node_type["max_workers"] == 2  # one per worker ip


@pytest.mark.parametrize("name", YAMLS)
def test_every_node_installs_skippy_and_the_model(name):
    config = prepare_config(load(name))
    for role in ("head", "worker"):
        setup = " ; ".join(config[f"{role}_setup_commands"])
        assert "skippy_mesh-*.whl" in setup and "ray[default]==2.60.0" in setup
        assert "skippy models pull smollm2" in setup
    assert config["file_mounts"] == {"~/skippy-dist": "./build/dist"}


@pytest.mark.parametrize("name", YAMLS)
def test_every_node_advertises_its_own_resource(name):
    config = load(name)
    head = " ".join(config["head_start_ray_commands"])
    worker = " ".join(config["worker_start_ray_commands"])
    assert re.search(r"ray start --head .*--resources=", head)
    assert re.search(r"ray start --address=\$RAY_HEAD_IP:6379 .*--resources=", worker)
    for commands in (head, worker):
        assert "NODE=skippy_node_" in commands and '{\\"$NODE\\": 1}' in commands


@pytest.mark.parametrize("name", YAMLS)
def test_the_head_starts_the_gateway_service_after_ray(name):
    """The gateway command (metadata.gateway, one place at the top) is the head's last
    start command; it waits for every node the YAML brings up, serves on the port the
    firewall opens, with the key file the head made. tests/test_service.py runs it."""
    raw = load(name)
    config = prepare_config(raw)
    gateway = raw["metadata"]["gateway"]
    head = config["head_start_ray_commands"]
    assert head[-1] == gateway and "ray start --head" in head[-2]
    assert not any("skippy service" in c for c in config["worker_start_ray_commands"])
    assert re.search(r"bin/skippy service start --wait \d+ -- ", gateway)
    for option in ("--address auto", "--host 0.0.0.0", "--port 8000",
                   "--api-keys-file ~/skippy-api-keys",
                   "--operator-keys-file ~/skippy-operator-keys", "--model smollm2"):
        assert option in gateway, option
    workers = len(raw["provider"].get("worker_ips", [])) or sum(
        t.get("min_workers", 0) for t in raw["available_node_types"].values())
    assert f"--wait-nodes {1 + workers} " in gateway
    if name == "cluster-aws.yaml":
        opened = raw["provider"]["security_group"]["IpPermissions"]
        assert [(p["FromPort"], p["ToPort"]) for p in opened] == [(8000, 8000)]


def test_aws_uses_cpu_instances():
    config = prepare_config(load("cluster-aws.yaml"))
    types = {t["node_config"]["InstanceType"] for t in config["available_node_types"].values()}
    assert all(re.fullmatch(r"(m|c|r)\d+[a-z]*\.\w+", t) for t in types), types


# -- Ray's token authentication ------------------------------------------------------------------
TOKEN_DIR = "~/skippy-ray-auth"
TOKEN_ENV = "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/skippy-ray-auth/token"


def secret_commands(config: dict) -> list[str]:
    return [c for c in config["head_setup_commands"] if "import secrets" in c]


@pytest.mark.parametrize("name", YAMLS)
def test_every_ray_command_runs_with_token_auth(name):
    text = (DEPLOY / name).read_text()
    assert "RAY_AUTH_MODE=disabled" not in text
    config = prepare_config(load(name))
    for role in ("head", "worker"):
        for command in config[f"{role}_start_ray_commands"]:
            assert TOKEN_ENV in command, command
            # ray itself, the gateway, or the worker's watcher (its `ray stop`)
            program = next(p for p in ("bin/ray ", "bin/skippy ", "bin/python ")
                           if p in command)
            assert command.index(TOKEN_ENV) < command.index(program), command
    # interactive shells (ray exec: skippy serve --address auto) present the token too
    shells = " ".join(c for c in config["setup_commands"] if ".bashrc" in c)
    assert 'RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$HOME/skippy-ray-auth/token"' in shells


@pytest.mark.parametrize("name", YAMLS)
def test_the_head_makes_the_token_and_the_workers_receive_it(name):
    config = prepare_config(load(name))
    made = secret_commands(config)
    assert any(f"{TOKEN_DIR}/token" in c for c in made)
    assert not any("import secrets" in c for c in config["worker_setup_commands"])
    assert config["cluster_synced_files"] == [TOKEN_DIR]  # head -> workers, rsync -a


def test_the_secret_commands_make_private_files_once(tmp_path):
    # Run them as a head would (bash, $HOME, ~/skippy-venv/bin/python): no Ray needed.
    (tmp_path / "skippy-venv").symlink_to(Path(sys.executable).parents[1])
    made = secret_commands(prepare_config(load("cluster-local.yaml")))
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    for command in made:
        subprocess.run(["bash", "-c", command], env=env, check=True)
    token = tmp_path / "skippy-ray-auth" / "token"
    keys, operators = tmp_path / "skippy-api-keys", tmp_path / "skippy-operator-keys"
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}\n", keys.read_text())
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}\n", operators.read_text())
    assert operators.read_text() != keys.read_text()
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in (token, keys, operators)} == {0o600}
    before = token.read_text(), keys.read_text(), operators.read_text()
    for command in made:  # `ray up` again keeps them
        subprocess.run(["bash", "-c", command], env=env, check=True)
    assert (token.read_text(), keys.read_text(), operators.read_text()) == before


def test_no_token_or_key_is_committed():
    tracked = subprocess.run(["git", "ls-files"], cwd=DEPLOY.parent, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    named = [p for p in tracked if re.search(r"auth_token|skippy-ray-auth|skippy-(api|operator)-keys|"
                                             r"(^|/)token$", p)]
    assert not named, named
    for path in sorted(DEPLOY.iterdir()):
        text = path.read_text()
        assert not re.search(r"\b[0-9a-f]{32,}\b", text), f"{path.name} holds a hex secret"
        assert not re.search(r"RAY_AUTH_TOKEN=\S", text), f"{path.name} sets a literal token"


_DRIVER = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(ray.get(ray.remote(lambda: "served").remote()))
"""

_HEAD = """
import sys, ray
from skippy.mesh.control.ray_engine import start_ray
start_ray(num_cpus=1)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


def gcs_call(address: str, token: str | None) -> str:
    """The status of one GCS call carrying `token` as Ray's clients do (or no token)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=30,
                              metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def test_a_token_auth_head_serves_only_token_holders(tmp_path):
    """Ray 2.60's token auth as the recipes set it (RAY_AUTH_MODE=token, the token in a
    file named by RAY_AUTH_TOKEN_PATH): a driver with the file is served, a call without
    the token or with another is refused. Starts Ray: run in the loopback-only namespace."""
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # socket paths: <= 107 bytes
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base |= {"HOME": str(tmp_path), "RAY_TMPDIR": ray_tmp}
    holder = base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    head = subprocess.Popen([sys.executable, "-c", _HEAD], env=holder, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        address = head.stdout.readline().strip()
        assert address, "the head did not start"

        r = subprocess.run([sys.executable, "-c", _DRIVER, address], env=holder,
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "served", r.stderr[-2000:]
        # Refusals asked of the GCS directly: a refused ray.init only says so after 20 s
        # of retries, while the server's answer is immediate.
        assert gcs_call(address, token.read_text()) == "OK"
        assert gcs_call(address, None) == "UNAUTHENTICATED"
        assert gcs_call(address, "0" * 64) == "UNAUTHENTICATED"
    finally:
        head.stdin.close()  # the head's ray.shutdown() stops what it started
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
