"""A block store whose bytes live in a directory that every stage process of a node shares.

One directory per node (on tmpfs for the RAM tier) holds each block once, as
`blocks/<hash>`, however many stage processes use it: the node's one physical copy. A
stage that puts bytes another stage of the node already stored only links them. Each
process (an owner) keeps its references in memory, with the same accounting as the
in-memory `BlockStore`, and one hard link per block it holds, `refs/<owner>/<hash>`: a
block's link count says how many owners hold it, so the last owner to let go removes
it, and the links of an owner that died (its pid gone, or held by a later process: the
owner's name carries its process's start time) are swept by the next one to open the
directory. Reads go through the owner's own link, so a block another owner let go
of meanwhile stays readable until this one does; every read is verified against the
hash, as in memory.

Measured on this 2-core machine (64 blocks of 1 MiB): files on tmpfs put 0.61 ms and
get (with the BLAKE3 check) 0.62 ms a block, against 3.7 and 2.9 ms through a Ray actor
that holds the blocks: the node's store is a directory, not an actor.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import zstandard
from blake3 import blake3

from .blocks import BlockStore, MissingBlock, StoreFull

STALE_TMP_S = 600.0  # a half-written block file older than this belonged to a dead writer


class DirBlockStore(BlockStore):
    def __init__(self, root: str | Path, max_bytes: int = 0, *, owner: str | None = None,
                 compress: bool = False):
        """max_bytes caps what this owner holds (its view of physical bytes); the node's
        copy is shared underneath it. compress: files hold zstd frames (a disk tier; every
        owner of a directory must agree)."""
        super().__init__(max_bytes)
        self._compress = compress
        self.root = Path(root)
        self._dir = self.root / "blocks"
        self.owner = owner or f"{os.getpid()}-{_started(os.getpid())}-{secrets.token_hex(4)}"
        self._mine = self.root / "refs" / self.owner
        self._dir.mkdir(parents=True, exist_ok=True)
        self._mine.mkdir(parents=True, exist_ok=True)
        self.linked_puts = 0  # new blocks for this owner that another owner had stored
        sweep(self.root, keep=self.owner)

    # -- blocks other owners of the node hold count as held here ---------------------------
    def has(self, digest: bytes) -> bool:
        return super().has(digest) or (self._dir / digest.hex()).exists()

    def get(self, digest: bytes) -> bytes:
        """The block's bytes, verified: this owner's, or the node's copy of another's."""
        try:
            return super().get(digest)
        except MissingBlock:
            data = self._read(self._dir / digest.hex())
            if data and blake3(data).digest() == digest:
                return data
            raise

    # -- where the bytes live ----------------------------------------------------------------
    def _keep(self, digest: bytes, data: bytes, held: object | None) -> object:
        if held is not None:
            return held  # already linked here; reads verify it
        name = digest.hex()
        mine, main = self._mine / name, self._dir / name
        _unlink(mine)
        try:
            os.link(main, mine)  # another owner of the node stored these bytes
            self.linked_puts += 1
            return mine
        except FileNotFoundError:
            pass
        tmp = self._dir / f".tmp-{self.owner}-{name}"
        try:  # only this user reads it (the folder is 0700 too), never through a link
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as fh:
                fh.write(zstandard.compress(data, 1) if self._compress else data)
        except OSError as e:  # the node's tmpfs or disk is full: as a cap would refuse it
            _unlink(tmp)
            raise StoreFull(len(data), self._physical, self._max_bytes) from e
        os.link(tmp, mine)
        try:
            os.link(tmp, main)
        except FileExistsError:  # another owner wrote it meanwhile: both copies are good
            pass
        os.unlink(tmp)
        return mine

    def _read(self, where: object) -> bytes:
        try:
            with open(where, "rb") as fh:
                raw = fh.read()
            # the module's functions: a (de)compressor object is not safe across threads
            return zstandard.decompress(raw) if self._compress else raw
        except (OSError, zstandard.ZstdError):
            return b""  # gone or garbled: read as a corrupt block, dropped, recomputed

    def _forget(self, digest: bytes, where: object) -> None:
        _unlink(where)
        _collect(self._dir / digest.hex())

    def _drop(self, digest: bytes, entry) -> None:
        # rotten bytes: no other owner of the node may link them from now on
        main = self._dir / digest.hex()
        if _same_file(main, entry.data):
            _unlink(main)
        super()._drop(digest, entry)

    # -- the node's view ----------------------------------------------------------------------
    def node_stats(self) -> dict[str, int]:
        """Blocks and bytes the node's directory holds: each block once, for all owners."""
        blocks = size = 0
        with os.scandir(self._dir) as it:
            for e in it:
                if not e.name.startswith("."):
                    blocks += 1
                    size += e.stat().st_size
        return {"node_blocks": blocks, "node_physical_bytes": size}

    def close(self) -> None:
        """Let go of every block this owner holds (the process ends)."""
        with self._lock:
            for digest, entry in list(self._blocks.items()):
                if entry.data is not None:
                    self._forget(digest, entry.data)
            self._blocks.clear()
            self._present = self._physical = self._logical = 0
        _rmdir(self._mine)

    def _corrupt_for_test(self, digest: bytes, offset: int = 0) -> None:
        """Flip one bit of a stored block's file in place, as disk or memory rot would."""
        with self._lock:
            where = self._blocks[digest].data
        with open(where, "r+b") as fh:
            fh.seek(offset % os.path.getsize(where))
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0x01]))


def sweep(root: Path, keep: str = "") -> None:
    """Remove the links of owners whose process is gone, then blocks no owner holds and
    half-written files left by dead writers."""
    refs = root / "refs"
    for owner in list(refs.iterdir()) if refs.is_dir() else []:
        if owner.name != keep and not _alive(owner.name):
            for link in owner.iterdir():
                _unlink(link)
            _rmdir(owner)
    now = time.time()
    with os.scandir(root / "blocks") as it:
        for e in it:
            try:
                st = e.stat()
            except OSError:
                continue
            if e.name.startswith(".tmp-"):
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(e.path)
            elif st.st_nlink == 1:
                _unlink(e.path)


def _collect(main: Path) -> None:
    """Remove a block file that no owner links any more."""
    try:
        if os.stat(main).st_nlink == 1:
            os.unlink(main)
    except OSError:
        pass


def _started(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat's 22nd field),
    or "" where that cannot be read: with the pid, a name no later process can take."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # fields after the command name, 3 on


def _alive(owner: str) -> bool:
    """Owner names are pid-start-token (pid-token before the start time was kept)."""
    parts = owner.split("-")
    try:
        pid = int(parts[0])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not one of ours to judge, or alive under another user
    if len(parts) == 3 and parts[1]:
        now = _started(pid)
        return not now or now == parts[1]  # the pid reused by a later process: gone
    return True


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
