"""The block stores a stage actor shares with every other stage process of its node: a
directory on the node's tmpfs (cache/block_dir.py), so state a stage exports, imports or
records is held once per node however many stages use it; and the disk tier's, under
the node's SKIPPY_HOME, compressed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from skippy.cache.block_dir import DirBlockStore

from ..models import model_home

SHM = Path("/dev/shm")


def node_store_root(address: str) -> Path:
    """One directory per node and user, named by the node's address (stable across
    restarts, distinct between hosts), in RAM where the node has a tmpfs."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"skippy-{os.getuid()}-blocks-{address.replace(':', '_')}"


def node_store(address: str, max_bytes: int) -> DirBlockStore:
    root = node_store_root(address)
    root.mkdir(mode=0o700, exist_ok=True)
    return DirBlockStore(root, max_bytes)


def cold_store(address: str, max_bytes: int) -> DirBlockStore:
    """The node's disk tier: entries evicted from RAM, zstd-compressed."""
    root = model_home() / "blocks" / address.replace(":", "_")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return DirBlockStore(root, max_bytes, compress=True)
