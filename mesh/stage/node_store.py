"""The block stores a stage actor shares with every other stage process of its node: a
directory on the node's tmpfs (cache/block_dir.py), so state a stage exports, imports or
records is held once per node however many stages use it; and the disk tier's, under
the node's SKIPPY_HOME, compressed."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from skippy.cache.block_dir import DirBlockStore
from skippy.topology.errors import UserError

from ..models import model_home

SHM = Path("/dev/shm")


def node_store_root(address: str) -> Path:
    """One directory per node and user, named by the node's address (stable across
    restarts, distinct between hosts), in RAM where the node has a tmpfs."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"skippy-{os.getuid()}-blocks-{address.replace(':', '_')}"


class StoreNotOurs(UserError):
    """The node store's folder exists and is not this user's private folder."""


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter: made 0700 where absent. One that exists
    must be a real folder (no symlink), this user's, open to no one else: the name is
    predictable, so anything else may have been planted by another local user (to read the
    blocks, or to have the sweep unlink files elsewhere) and is refused, never used. In a
    sticky tmpfs (/dev/shm, /tmp) nobody else can swap the folder once it is ours."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}"
    elif st.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return path
    raise StoreNotOurs(f"the node's block store {path} {problem}; another user may have "
                       f"made it: remove it, then start again")


def node_store(address: str, max_bytes: int) -> DirBlockStore:
    return DirBlockStore(private_dir(node_store_root(address)), max_bytes)


def cold_store(address: str, max_bytes: int) -> DirBlockStore:
    """The node's disk tier: entries evicted from RAM, zstd-compressed."""
    root = model_home() / "blocks" / address.replace(":", "_")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return DirBlockStore(root, max_bytes, compress=True)
