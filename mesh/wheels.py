"""Fetch one binary wheel with pip, and copy one member out of it, bounded.

pip runs isolated (`--isolated`, `PIP_CONFIG_FILE=/dev/null`, no `PIP_*` variables): a
user's pip settings (constraints, pre-releases, a source build, a target directory) must
not change which file a pull fetches. The site's index and certificate settings are the
exception, since a machine behind a mirror or a proxy's CA can pull nothing without them:
those, and only those (`CARRIED`), are read from pip's own configuration and passed on
the command line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import BinaryIO

CARRIED = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "client-cert")
# Options that pip accepts several times; their config values are whitespace-separated.
_MANY = frozenset({"extra-index-url", "find-links", "trusted-host"})
CHUNK = 1 << 20  # extraction moves 1 MiB at a time: flat memory on 250 MB files
# pip's `--progress-bar raw` lines on stdout (pip >= 24.1), a few times a second
_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


class WheelError(Exception):
    """A wheel cannot be downloaded or read as expected; the message is one line."""


def site_pip_settings() -> dict[str, str]:
    """The `CARRIED` settings this machine's pip would use for `pip download` (its config
    files and `PIP_*` variables, in pip's precedence: [global] < [download] < environment)."""
    try:
        from pip._internal.configuration import Configuration
    except ImportError as e:
        raise WheelError(f"pulling a model needs pip in this Python ({e})") from None
    config = Configuration(isolated=False)
    config.load()
    return carried_settings(config.items())


def carried_settings(files: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """The `CARRIED` keys from pip configuration items ({"section.key": value} per file,
    files in pip's load order, the environment last as ":env:"; pips before 24 give one
    merged list of ("section.key", value) instead)."""
    files = list(files)
    if files and isinstance(files[0][1], str):
        files = [("", dict(files))]
    by_section: dict[str, dict[str, str]] = {"global": {}, "download": {}, ":env:": {}}
    for _file, items in files:
        for section_key, value in items.items():
            section, key = section_key.split(".", 1)
            if section in by_section and key in CARRIED and value:
                by_section[section][key] = value
    out: dict[str, str] = {}
    for section in ("global", "download", ":env:"):
        out.update(by_section[section])
    return out


def download_command(spec: str, into: Path,
                     settings: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of `pip download` for one wheel of `spec`: binary only, no
    dependencies, no prompts, pip's configuration off but for `settings` (CARRIED keys)."""
    # Not -q where pip can say its download progress as lines: a pull shows it as a bar.
    say = ["--progress-bar", "raw"] if _pip_says_progress() else ["-q"]
    cmd = [sys.executable, "-m", "pip", "--isolated", "--no-input",
           "--disable-pip-version-check", "download", "--no-deps", "--only-binary=:all:",
           *say, "-d", str(into)]
    for key in CARRIED:
        value = settings.get(key)
        if value:
            values = value.split() if key in _MANY else [value]
            cmd += [arg for v in values for arg in (f"--{key}", v)]
    cmd.append(spec)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no config file at all
    return cmd, env


def _pip_says_progress() -> bool:
    """Whether this Python's pip has `--progress-bar raw` (pip 24.1 and later)."""
    try:
        major, minor = (int(x) for x in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def download_wheel(spec: str, into: Path,
                   progress: Callable[[int, int], None] | None = None) -> Path:
    """Download the one wheel of `spec` into the new folder `into`; return its path.
    `progress(done, total)` hears the bytes pip has fetched (nothing for a file that pip
    copies from a local folder or takes from its cache)."""
    into.mkdir()
    cmd, env = download_command(spec, into, site_pip_settings())
    with tempfile.TemporaryFile("w+") as err:  # a file: a chatty stderr cannot block pip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        with proc.stdout:
            for line in proc.stdout:
                m = _PROGRESS.match(line.strip())
                if m and progress is not None:
                    progress(int(m[1]), int(m[2]))
        returncode = proc.wait()
        err.seek(0)
        stderr = err.read()
    if returncode != 0:
        raise WheelError(f"pip could not download {spec}: {_last_error(stderr)}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise WheelError(f"pip download of {spec} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _last_error(stderr: str) -> str:
    # pip prints harmless WARNING lines (unreachable local indexes) before the real error.
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no error output"])[-1]


def copy_member(wheel: Path, member: str, dst: BinaryIO, limit: int,
                on_chunk: Callable[[bytes], None]) -> int:
    """Append the member's bytes to `dst` (each chunk also to `on_chunk`); return how many.

    Stops with WheelError before writing past `limit` bytes, whether the zip header
    declares more or the decompressed stream runs on: a wheel cannot fill the disk.
    """
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            if info.file_size > limit:
                raise WheelError(f"{wheel.name}: {member} is {info.file_size} bytes, more "
                                 f"than the {limit} expected")
            copied = 0
            with zf.open(info) as src:
                # Ask for one byte past the limit at most: a longer stream shows, and
                # nothing beyond that byte is ever decompressed.
                while chunk := src.read(min(CHUNK, limit + 1 - copied)):
                    copied += len(chunk)
                    if copied > limit:
                        raise WheelError(f"{wheel.name}: {member} decompresses past the "
                                         f"{limit} bytes expected")
                    dst.write(chunk)
                    on_chunk(chunk)
            return copied
    except KeyError:
        raise WheelError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise WheelError(f"{wheel.name} is not a valid zip ({e})") from None
