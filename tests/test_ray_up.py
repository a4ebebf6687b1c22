"""`ray up` for real: the `ray` CLI, over SSH, turns hosts that start empty
(tests/ssh_hosts.py: their own network, PIDs, /root and /tmp) into a serving cluster with
deploy/cluster-local.yaml's own steps — a venv, the product's and llama.cpp's wheels
shipped from `make dist`'s folder, every other package from the package index the hosts
are set up with (here a local mirror: they reach no network but the test's bridge), the
model pulled, Ray started with its token, the gateway service started on the head. A
chat is answered through it, then `ray down` leaves nothing of ours on the hosts (the
gateway ends with its Ray: mesh/control/cluster_watch.py). The YAML is the repository's,
with only its addresses, SSH login, file sources and stage counts set for the harness.

The head alone by default (the smallest run that goes through SSH, about a minute);
SKIPPY_RAY_UP_WORKERS=2 brings up the YAML's two workers too (Ray's local provider runs
`ray stop` on the head only: the YAML's watcher on each worker stops its Ray once the
head's is gone). Prints each step's time.
Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ssh_hosts import ssh_hosts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKERS = int(os.environ.get("SKIPPY_RAY_UP_WORKERS", "0"))
WHEELHOUSE = Path.home() / ".cache/skippy/wheelhouse"  # Makefile


def _dist(dest: Path) -> Path:
    """`make dist`'s folder (this checkout's wheel, the llama.cpp wheel built here) with,
    as the hosts' package mirror, the wheels `make wheelhouse` fetched (linked in)."""
    if not WHEELHOUSE.is_dir():
        message = f"no {WHEELHOUSE}: `make wheelhouse` fetches what the hosts install"
        if os.environ.get("SKIPPY_REQUIRE_SSH"):
            pytest.fail(message)
        pytest.skip(message)
    subprocess.run([str(BIN / "pip"), "-q", "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(dest), str(REPO)], check=True, capture_output=True)
    llama = sorted(glob.glob(str(Path.home() / ".cache/skippy/wheels/llama-cpp-python-*/"
                                 "llama_cpp_python-*.whl")))
    assert llama, "no llama-cpp-python wheel built here (make venv builds it)"
    shutil.copy(llama[-1], dest)
    for wheel in WHEELHOUSE.iterdir():
        if not (dest / wheel.name).exists():
            try:
                os.link(wheel, dest / wheel.name)
            except OSError:  # another file system
                shutil.copy(wheel, dest)
    return dest


def _cluster_yaml(root: Path, hosts, key: Path, dist: Path) -> Path:
    """deploy/cluster-local.yaml for these hosts: addresses, login, where its files come
    from (and the hosts' pip pointed at them), how many nodes the gateway waits for."""
    raw = yaml.safe_load((REPO / "deploy/cluster-local.yaml").read_text())
    raw["cluster_name"] = f"skippy-test-{os.getpid()}"
    raw["provider"].update(head_ip=hosts[0].ip, worker_ips=[h.ip for h in hosts[1:]])
    raw["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    pip_conf = root / "pip.conf"
    pip_conf.write_text("[global]\nno-index = true\nfind-links = /root/skippy-dist\n")
    raw["file_mounts"] = {"~/skippy-dist": str(dist), "~/.config/pip/pip.conf": str(pip_conf)}
    gateway = raw["metadata"]["gateway"]
    assert "--stages 2 --wait-nodes 3" in gateway
    gateway = gateway.replace("--stages 2 --wait-nodes 3",
                              f"--stages {min(2, len(hosts))} --wait-nodes {len(hosts)}")
    raw["metadata"]["gateway"] = raw["head_start_ray_commands"][-1] = gateway
    out = root / "cluster.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _ray(*args: str, timeout: float) -> float:
    """A `ray` command as deploy/README.md gives it (Ray's autoscaler v1: v2, `ray up`'s
    default since Ray 2.50, brings up one of the local provider's workers only)."""
    t = time.monotonic()
    done = subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_UP_enable_autoscaler_v2": "0"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return time.monotonic() - t


def _chat(head, key: str) -> str:
    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    request = urllib.request.Request(
        f"http://{head.ip}:8000/v1/chat/completions", json.dumps(body).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_ray_up_serves_from_empty_hosts_and_ray_down_leaves_nothing(tmp_path):
    dist = _dist(tmp_path / "dist")
    with ssh_hosts(tmp_path / "hosts", 1 + WORKERS) as (hosts, key):
        config = _cluster_yaml(tmp_path, hosts, key, dist)
        state = Path(f"/tmp/ray/cluster-skippy-test-{os.getpid()}.state")
        try:
            up = _ray("up", "-y", "--no-config-cache", str(config), timeout=1200)
            api_key = (hosts[0].home / "skippy-api-keys").read_text().split()[0]
            t = time.monotonic()
            answer = _chat(hosts[0], api_key)
            chat = time.monotonic() - t
            assert answer.strip()
            down = _ray("down", "-y", str(config), timeout=300)
            t = time.monotonic()
            # `ray down` stops the head's Ray; each worker's watcher stops its own once the
            # head's GCS has refused a few connects (mesh/control/cluster_watch.py)
            deadline = time.monotonic() + 60
            while left := [c for h in hosts for c in h.commands()  # the SSH server's only
                           if not c.startswith(("unshare ", "sshd:"))]:
                assert time.monotonic() < deadline, left
                time.sleep(0.5)
            gone = time.monotonic() - t
        finally:
            state.unlink(missing_ok=True)
    print(f"\nray up ({1 + WORKERS} host(s), from empty): {up:.0f} s; a chat through the "
          f"gateway: {chat:.1f} s; ray down: {down:.0f} s, nothing of ours left "
          f"{gone:.0f} s after it")
