"""The `skippy` command as a user runs it, in a child process of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

COMMAND = [sys.executable, "-m", "skippy.mesh.cli"]


def skippy(*args: str, env: dict[str, str] | None = None, timeout: float = 600
           ) -> subprocess.CompletedProcess:
    """`skippy ARGS` with pipes for stdout and stderr, as in CI, and no stdin; `env` is the
    child's whole environment (default: this process's)."""
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL,
                          env=dict(os.environ) if env is None else env)
