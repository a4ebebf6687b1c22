"""An eval run as a command says a user's mistake in one line (evals/entry.py)."""

from __future__ import annotations

import subprocess
import sys


def test_an_unknown_model_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "skippy.evals.bench_mesh", "--model",
                        "no-such-model", "--skip-hops"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_mesh: error: "), r.stderr
    assert "no-such-model" in lines[0]
