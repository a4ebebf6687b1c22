"""Content-addressed block store: 1 MiB blocks keyed by their BLAKE3-256 digest, refcounted.

A block is stored once however many payloads use it; each `put` of existing bytes adds a
reference, each `release` drops one, and the block is freed with its last reference. Every
`get` re-hashes the bytes, so a block that rotted in memory or on the way in is never
returned: it is dropped and reported as `CorruptBlock`, which callers treat as a miss.

Lock discipline: every cache object guards its state with one lock of its own and never
calls another cache object while holding it, so locks never nest. Here that lock is held
only for dictionary and counter updates; hashing runs outside it, and nothing is called
back while it is held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from blake3 import blake3

BLOCK_SIZE = 1 << 20
DIGEST_SIZE = 32


class BlockError(Exception):
    """A block cannot be served; the caller recomputes what it would have restored."""

    def __init__(self, digest: bytes, message: str):
        super().__init__(f"{message}: {digest.hex()}")
        self.digest = digest


class MissingBlock(BlockError, KeyError):
    """No block with this digest is stored (never was, released, or dropped as corrupt)."""

    def __init__(self, digest: bytes):
        BlockError.__init__(self, digest, "missing block")

    __str__ = Exception.__str__  # KeyError would print the message in quotes


class CorruptBlock(BlockError):
    """The stored bytes no longer hash to their digest; the block has been dropped."""

    def __init__(self, digest: bytes):
        super().__init__(digest, "corrupt block")


class StoreFull(Exception):
    """A new block would take physical bytes past the store's cap; nothing was stored."""

    def __init__(self, size: int, physical_bytes: int, max_bytes: int):
        super().__init__(f"block of {size} B refused: {physical_bytes} B of {max_bytes} B used")
        self.size = size
        self.physical_bytes = physical_bytes
        self.max_bytes = max_bytes


@dataclass(frozen=True)
class BlockStoreStats:
    blocks: int           # distinct blocks held
    physical_bytes: int   # bytes held, each block once
    logical_bytes: int    # bytes as the references see them: sum over refs of block size
    saved_bytes: int      # logical - physical: what deduplication saves
    max_bytes: int        # cap on physical bytes; 0 = unlimited
    puts: int             # accepted puts, new or deduplicated
    dedup_puts: int       # puts whose block was already held
    refused_puts: int     # puts refused by the cap
    gets: int             # = hits + misses + corrupt_reads
    hits: int
    misses: int
    corrupt_reads: int


@dataclass(slots=True)
class _Entry:
    data: object | None  # where the bytes are (`_keep`); None once dropped as corrupt
    refs: int
    size: int


class BlockStore:
    """Refcounted BLAKE3-addressed blocks of 1..BLOCK_SIZE bytes, with an optional byte cap.

    The cap is never met by eviction: blocks are freed only when unreferenced, so a put
    that does not fit raises `StoreFull` and the caller decides what to release.
    """

    def __init__(self, max_bytes: int = 0):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = unlimited), got {max_bytes}")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._blocks: dict[bytes, _Entry] = {}
        self._present = 0
        self._physical = 0
        self._logical = 0
        self._puts = self._dedup_puts = self._refused_puts = 0
        self._gets = self._hits = self._misses = self._corrupt_reads = 0

    def put(self, data: bytes | bytearray | memoryview) -> bytes:
        """Store `data` (or add a reference to the identical stored block); returns its digest.

        Raises `StoreFull` if a block not already held would exceed the cap.
        """
        data = bytes(data)  # our own immutable copy: the caller may reuse its buffer
        if not 0 < len(data) <= BLOCK_SIZE:
            raise ValueError(f"a block holds 1..{BLOCK_SIZE} bytes, got {len(data)}")
        digest = blake3(data).digest()
        with self._lock:
            entry = self._blocks.get(digest)
            grows = entry is None or entry.data is None
            if grows and self._max_bytes and self._physical + len(data) > self._max_bytes:
                self._refused_puts += 1
                raise StoreFull(len(data), self._physical, self._max_bytes)
            where = self._keep(digest, data, None if entry is None else entry.data)
            self._puts += 1
            if entry is None:
                entry = self._blocks[digest] = _Entry(None, 0, len(data))
            elif entry.data is None:
                # Refilling a block dropped as corrupt: the references that outlived it count again.
                self._logical += entry.refs * entry.size
            else:
                self._dedup_puts += 1
            if grows:
                self._present += 1
                self._physical += entry.size
            entry.data = where
            entry.refs += 1
            self._logical += entry.size
        return digest

    def get(self, digest: bytes) -> bytes:
        """The block's bytes, verified against `digest` on every read.

        Raises `MissingBlock` if it is not held, `CorruptBlock` if its bytes no longer match
        (the block is then dropped, so later reads miss until it is put again).
        """
        with self._lock:
            entry = self._blocks.get(digest)
            where = entry.data if entry is not None else None
            if where is None:
                self._gets += 1
                self._misses += 1
                raise MissingBlock(digest)
        data = self._read(where)
        ok = blake3(data).digest() == digest  # read and hashed outside the lock
        with self._lock:
            self._gets += 1  # counted with its outcome: gets == hits + misses + corrupt
            if ok:
                self._hits += 1
                return data
            self._corrupt_reads += 1
            entry = self._blocks.get(digest)
            if entry is not None and entry.data is where:  # not healed by a put meanwhile
                self._drop(digest, entry)
        raise CorruptBlock(digest)

    def has(self, digest: bytes) -> bool:
        with self._lock:
            entry = self._blocks.get(digest)
            return entry is not None and entry.data is not None

    def refs(self, digest: bytes) -> int:
        """References held on `digest` (they survive a corrupt drop until released)."""
        with self._lock:
            entry = self._blocks.get(digest)
            return entry.refs if entry is not None else 0

    def retain(self, digest: bytes) -> None:
        """One more reference on a held block (a second owner of a payload already
        stored); raises `MissingBlock` if it is not held."""
        with self._lock:
            entry = self._blocks.get(digest)
            if entry is None or entry.data is None:
                raise MissingBlock(digest)
            entry.refs += 1
            self._logical += entry.size

    def release(self, digest: bytes) -> None:
        """Drop one reference; the block is freed with its last. Releasing more references
        than were put raises `MissingBlock`."""
        with self._lock:
            entry = self._blocks.get(digest)
            if entry is None:
                raise MissingBlock(digest)
            entry.refs -= 1
            if entry.data is not None:
                self._logical -= entry.size
            if entry.refs == 0:
                if entry.data is not None:
                    self._present -= 1
                    self._physical -= entry.size
                    self._forget(digest, entry.data)
                del self._blocks[digest]

    def stats(self) -> BlockStoreStats:
        with self._lock:
            return BlockStoreStats(
                blocks=self._present,
                physical_bytes=self._physical,
                logical_bytes=self._logical,
                saved_bytes=self._logical - self._physical,
                max_bytes=self._max_bytes,
                puts=self._puts,
                dedup_puts=self._dedup_puts,
                refused_puts=self._refused_puts,
                gets=self._gets,
                hits=self._hits,
                misses=self._misses,
                corrupt_reads=self._corrupt_reads,
            )

    def close(self) -> None:
        """The owner is done with the store (its memory goes with it here)."""

    def node_stats(self) -> dict[str, int]:
        """What the node holds for all its stages, where they share a store (none here)."""
        return {}

    def _drop(self, digest: bytes, entry: _Entry) -> None:
        # Keep the entry (refs and size) so that the payloads still holding references can
        # release them, and so a later put of the good bytes restores a consistent count.
        self._present -= 1
        self._physical -= entry.size
        self._logical -= entry.refs * entry.size
        self._forget(digest, entry.data)
        entry.data = None

    # -- where the bytes live: here, in memory; cache/block_dir.py keeps them in files ----
    def _keep(self, digest: bytes, data: bytes, held: object | None) -> object:
        """Keep a put's bytes (under the lock); returns what `_read` reads them from.
        `held`: where they are already, if they are. These bytes were just hashed, so they
        are known good: keeping them heals a stored copy that may have rotted."""
        return data

    def _read(self, where: object) -> bytes:
        return where

    def _forget(self, digest: bytes, where: object) -> None:
        """The block is freed or dropped: let go of its bytes (under the lock)."""

    def _corrupt_for_test(self, digest: bytes, offset: int = 0) -> None:
        """Flip one bit of a stored block in place, as memory rot would."""
        with self._lock:
            entry = self._blocks[digest]
            data = bytearray(entry.data)
            data[offset % len(data)] ^= 0x01
            entry.data = bytes(data)
