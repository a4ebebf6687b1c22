"""A package part is hashed and read through one open file: bytes that changed after (or
while) the part was checked never reach a stage."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from skippy.stages.package import split_package
from skippy.topology import package_part
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_package import ModelPackage, PackageError, check_part

LAYER0 = "layer-000.gguf"
NORM, UP = "blk.0.attn_norm.weight", "blk.0.ffn_up.weight"


def _tiny_gguf(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 8), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(8, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((8, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Path]:
    """(the source GGUF, its package)."""
    _tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    split_package(tmp_path / "tiny.gguf", tmp_path / "pkg")
    return tmp_path / "tiny.gguf", tmp_path / "pkg"


def _other_layer0(tmp_path: Path) -> Path:
    """layer-000.gguf of another model of the same shapes: a valid part, other bytes."""
    _tiny_gguf(tmp_path / "other.gguf", seed=1)
    split_package(tmp_path / "other.gguf", tmp_path / "other")
    return tmp_path / "other" / LAYER0


def _source(src: Path, name: str) -> np.ndarray:
    f = GGUFFile(src)
    try:
        return np.array(f.raw(name))
    finally:
        f.close()


def _flip_tensor_byte(part: Path, name: str) -> None:
    f = GGUFFile(part)
    at = f.tensors[name].offset
    f.close()
    with open(part, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_reads_give_the_source_bytes(tiny):
    src, pkg = tiny
    p = ModelPackage(pkg)
    for name in (NORM, UP, "token_embd.weight", "output_norm.weight"):
        assert np.array_equal(p.raw(name), _source(src, name))
    p.close()


def test_a_part_replaced_after_its_check_is_never_read(tiny, tmp_path):
    src, pkg = tiny
    p = ModelPackage(pkg)
    p.raw(NORM)  # opens and checks layer-000
    os.replace(_other_layer0(tmp_path), pkg / LAYER0)  # same size, other bytes
    assert np.array_equal(p.raw(UP), _source(src, UP))  # still the checked file's bytes
    p.close()
    with pytest.raises(PackageError, match=f"{LAYER0} is corrupted"):
        ModelPackage(pkg).raw(UP)  # a new open checks the new file


def test_a_part_rewritten_in_place_after_its_check_fails_the_read(tiny):
    _, pkg = tiny
    p = ModelPackage(pkg)
    p.raw(NORM)
    _flip_tensor_byte(pkg / LAYER0, UP)
    with pytest.raises(PackageError, match=f"part {LAYER0} changed after it was checked "
                                           f"\\({UP} differs\\)"):
        p.raw(UP)
    p.close()


def test_a_part_truncated_after_its_check_fails_the_read(tiny):
    _, pkg = tiny
    p = ModelPackage(pkg)
    p.raw(NORM)
    with open(pkg / LAYER0, "r+b") as fh:
        fh.truncate(os.path.getsize(pkg / LAYER0) - 8)
    with pytest.raises(PackageError, match=f"part {LAYER0} ended .* early"):
        p.raw(UP)


def test_a_part_replaced_between_hash_and_read_cannot_pass(tiny, tmp_path, monkeypatch):
    # The race a hash-then-reopen reader loses: the file changes right after it was hashed.
    src, pkg = tiny
    other = _other_layer0(tmp_path)
    real_hash = package_part.hash_fd

    def hash_then_swap(fd, size, label, progress=None, sink=None):
        digest = real_hash(fd, size, label, progress, sink)
        if label.endswith(LAYER0):
            shutil.copyfile(other, pkg / "swap")
            os.replace(pkg / "swap", pkg / LAYER0)
        return digest

    monkeypatch.setattr(package_part, "hash_fd", hash_then_swap)
    p = ModelPackage(pkg)
    assert np.array_equal(p.raw(UP), _source(src, UP))
    assert np.array_equal(p.raw(NORM), _source(src, NORM))


def test_a_part_rewritten_between_hash_and_read_cannot_pass(tiny, monkeypatch):
    _, pkg = tiny
    real_hash = package_part.hash_fd

    def hash_then_flip(fd, size, label, progress=None, sink=None):
        digest = real_hash(fd, size, label, progress, sink)
        if label.endswith(LAYER0):
            _flip_tensor_byte(pkg / LAYER0, UP)
        return digest

    monkeypatch.setattr(package_part, "hash_fd", hash_then_flip)
    p = ModelPackage(pkg)
    with pytest.raises(PackageError, match="changed after it was checked"):
        p.raw(UP)


def test_a_part_replaced_while_it_is_checked_is_refused(tiny, tmp_path, monkeypatch):
    # Swapped after the open but before the header is read by name: the header parsed
    # from the hashed bytes is the one used, and a layout that differs is refused.
    _, pkg = tiny
    bigger = tmp_path / "bigger.gguf"
    w = GGUFWriter(str(bigger), "llama")
    w.add_tensor("blk.0.other.weight", np.zeros(4096, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    real_open = package_part.open_part_file

    def open_then_swap(directory, file, size):
        fd = real_open(directory, file, size)
        if file == LAYER0:
            os.replace(bigger, directory / file)
        return fd

    monkeypatch.setattr(package_part, "open_part_file", open_then_swap)
    p = ModelPackage(pkg)
    with pytest.raises(PackageError, match=f"{LAYER0} changed while it was being checked"):
        p.raw(UP)


def test_check_part_sizes_and_hashes_one_open_file(tiny, tmp_path):
    from skippy.topology.model_package import PackageManifest
    _, pkg = tiny
    entry = PackageManifest.load(pkg).part("layer-000")
    check_part(pkg, entry)
    (pkg / LAYER0).unlink()
    (pkg / LAYER0).mkdir()
    with pytest.raises(PackageError, match=f"{LAYER0} is missing \\(not a regular file\\)"):
        check_part(pkg, entry)
