"""The cluster YAMLs pass Ray's own launcher checks (`ray up` minus the SSH and the cloud).

prepare_config fills in the provider's defaults and node types exactly as `ray up` does,
and validate_config checks the result against Ray's schema. Neither touches the network:
the AWS provider's bootstrap (boto3, key pairs, security groups) is a later step that
these checks do not reach, so no cloud client is needed.
"""

from __future__ import annotations

import re
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


def test_aws_uses_cpu_instances():
    config = prepare_config(load("cluster-aws.yaml"))
    types = {t["node_config"]["InstanceType"] for t in config["available_node_types"].values()}
    assert all(re.fullmatch(r"(m|c|r)\d+[a-z]*\.\w+", t) for t in types), types
