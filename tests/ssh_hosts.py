"""Hosts that start empty and are reached over SSH, for `ray up` (tests/test_ray_up.py).

Each host is a network namespace on tests/hosts.py's bridge, running Debian's sshd in a
PID and mount namespace of its own: its own /root (an empty folder, but for the
`.sshd` folder its server reads) and its own /tmp. `ray stop`, which `ray up` and `ray
down` run there, then sees that host's processes only, never the machine's other Rays.
Everything else of the machine (/usr, the Python the recipes find) is shared, as on
identical machines.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hosts import BRIDGE_IP, SUBNET, _ip, _unwire, _wire, check_allowed

SSHD = "/usr/sbin/sshd"


@dataclass(frozen=True)
class SshHost:
    netns: str
    ip: str
    home: Path  # its /root

    def pids(self) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                              text=True)
        return [int(p) for p in done.stdout.split()]

    def commands(self) -> list[str]:
        """Each process's command line in this host."""
        out = []
        for pid in self.pids():
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                           .decode(errors="replace").strip())
        return out


def check_ssh() -> None:
    """Skip (or, with SKIPPY_REQUIRE_SSH set, fail) where sshd or rsync is missing."""
    missing = [p for p in (SSHD, shutil.which("rsync") or "rsync") if not Path(p).exists()]
    if missing:
        message = f"ray up over SSH needs Debian's openssh-server and rsync ({missing} missing)"
        if os.environ.get("SKIPPY_REQUIRE_SSH"):
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def ssh_hosts(root: Path, n: int) -> Iterator[tuple[list[SshHost], Path]]:
    """n hosts at 10.88.0.1, .2, ...: (the hosts, the private key that logs in as root)."""
    check_ssh()
    check_allowed()
    keys = root / "keys"
    keys.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id")],
                   check=True)
    tag = f"su{os.getpid()}"
    hosts = [SshHost(f"{tag}h{i}", f"{SUBNET}.{i}", root / f"h{i}" / "home")
             for i in range(1, n + 1)]
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    try:
        _wire(hosts)
        for h in hosts:  # a default route, as a machine has: Ray finds its node's
            # address by routing (no packet leaves: the bridge goes nowhere further)
            _ip("-n", h.netns, "route", "add", "default", "via", BRIDGE_IP)
            _start_sshd(h, keys / "id.pub")
        yield hosts, keys / "id"
    finally:
        _unwire(hosts)


def _start_sshd(h: SshHost, public_key: Path) -> None:
    conf = h.home / ".sshd"
    conf.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(conf / "host")],
                   check=True)
    shutil.copy(public_key, conf / "authorized_keys")
    (conf / "sshd_config").write_text(
        f"ListenAddress {h.ip}\nHostKey /root/.sshd/host\nPermitRootLogin prohibit-password\n"
        "AuthorizedKeysFile /root/.sshd/authorized_keys\nStrictModes no\nUsePAM no\n"
        "PidFile none\nSubsystem sftp internal-sftp\n")
    # its own PIDs, /root and /tmp; then sshd, which reads its config from the new /root
    inner = (f'mount --bind "{h.home}" /root && mount -t tmpfs skippy-tmp /tmp && '
             f"exec {SSHD} -D -e -f /root/.sshd/sshd_config")
    subprocess.Popen(["ip", "netns", "exec", h.netns, "unshare", "--pid", "--fork",
                      "--mount-proc", "--mount", "sh", "-c", inner],
                     stdout=open(h.home.parent / "sshd.log", "w"), stderr=subprocess.STDOUT,
                     start_new_session=True)
    deadline = time.monotonic() + 10
    while subprocess.run(["ip", "netns", "exec", h.netns, "bash", "-c",
                          f"exec 3<>/dev/tcp/{h.ip}/22"], capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {h.ip} did not listen: "
                               f"{(h.home.parent / 'sshd.log').read_text()}")
        time.sleep(0.1)
