"""The node's block store folder has a name anyone can predict: a folder planted there by
another local user (a symlink, someone else's folder, one open to others) is refused, never
used, and what it points at is left alone."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess

import pytest

from skippy.mesh.stage.node_store import StoreNotOurs, node_store, node_store_root


@pytest.fixture
def address():
    """A node address no one else uses, and its store folder removed afterwards."""
    addr = f"10.254.{secrets.randbelow(250)}.{secrets.randbelow(250)}:{secrets.randbelow(60000)}"
    root = node_store_root(addr)
    yield addr
    if root.is_symlink() or root.is_file():
        root.unlink()
    elif root.exists():
        shutil.rmtree(root)


def test_a_fresh_store_is_private_and_reopened(address):
    store = node_store(address, 1 << 20)
    root = node_store_root(address)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    digest = store.put(b"x" * 100)
    assert node_store(address, 1 << 20).get(digest) == b"x" * 100


def test_a_planted_symlink_is_refused_and_its_target_left_alone(address, tmp_path):
    decoy = tmp_path / "decoy"
    (decoy / "refs" / "1-dead").mkdir(parents=True)
    (decoy / "blocks").mkdir()
    (decoy / "blocks" / "victim").write_text("keep me")
    os.link(decoy / "blocks" / "victim", decoy / "refs" / "1-dead" / "victim")
    node_store_root(address).symlink_to(decoy)
    with pytest.raises(StoreNotOurs, match="symbolic link"):
        node_store(address, 1 << 20)
    assert (decoy / "blocks" / "victim").read_text() == "keep me"
    assert (decoy / "refs" / "1-dead" / "victim").exists()


def test_a_folder_open_to_others_is_refused(address):
    root = node_store_root(address)
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StoreNotOurs, match="open to other users"):
        node_store(address, 1 << 20)
    assert not (root / "blocks").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another uid needs root")
def test_another_users_folder_is_refused(address):
    root = node_store_root(address)
    root.mkdir(mode=0o700)
    os.chown(root, 54321, 54321)
    with pytest.raises(StoreNotOurs, match="belongs to uid 54321"):
        node_store(address, 1 << 20)
    assert not (root / "blocks").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="running as another uid needs root")
def test_another_user_reads_no_block(address):
    store = node_store(address, 1 << 20)
    digest = store.put(b"a prompt's layer-0 keys" * 100)
    block = node_store_root(address) / "blocks" / digest.hex()
    assert stat.S_IMODE(block.stat().st_mode) == 0o600
    os.chmod(block, 0o644)  # even a block open to others sits behind the 0700 folder
    denied = subprocess.run(["cat", str(block)], user=54321, group=54321,
                            capture_output=True, text=True)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
