"""One package part opened once: hashed, parsed and read through the same open file.

A stage checks a part when it first needs it. The part's bytes are read once through one
file descriptor and hashed whole (the manifest's BLAKE3) and tensor by tensor, and its GGUF
header is parsed from the very bytes that were hashed. Every later tensor read goes through
that descriptor and is hashed again against the digest the tensor had in the checked pass.
So a part swapped for another file after the check is never read (the descriptor still
names the checked file), and one rewritten in place fails its next read: no byte that was
not checked reaches the weights, and nothing is hashed on one open and read on another.
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np

from .errors import UserError
from .gguf_file import GGUFError, GGUFFile, TensorInfo

_CHUNK = 8 * 2**20


class PackageError(UserError):
    """A package is missing, malformed or corrupted; the message names the part."""


def _new_hasher() -> blake3.blake3:
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def open_part_file(directory: Path, file: str, size: int) -> int:
    """A read-only descriptor of the part, after checking (on that descriptor) that it is a
    regular file of the manifest's size."""
    try:
        fd = os.open(directory / file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PackageError(f"{directory}: part {file} is missing") from None
    except OSError as e:
        raise PackageError(f"{directory}: part {file} cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PackageError(f"{directory}: part {file} is missing (not a regular file)")
    if st.st_size != size:
        os.close(fd)
        raise PackageError(f"{directory}: part {file} has {st.st_size} bytes, the manifest "
                           f"says {size} (truncated or replaced)")
    return fd


def read_at(fd: int, out: memoryview, offset: int, label: str) -> None:
    """Fill `out` from the descriptor at `offset`; a file that ends first is an error."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise PackageError(f"{label} ended {len(out) - done} bytes early (truncated)")
        done += n


def hash_fd(fd: int, size: int, label: str, progress: Callable[[int], None] | None = None,
            sink: Callable[[int, memoryview], None] | None = None) -> str:
    """BLAKE3 of the descriptor's first `size` bytes, read in chunks (no mapping: the pages
    never count as ours); `sink(offset, chunk)` sees every chunk that was hashed."""
    h = _new_hasher()
    buf = bytearray(min(_CHUNK, max(size, 1)))
    pos = 0
    while pos < size:
        view = memoryview(buf)[:min(len(buf), size - pos)]
        read_at(fd, view, pos, label)
        h.update(view)
        if sink is not None:
            sink(pos, view)
        if progress is not None:
            progress(len(view))
        pos += len(view)
    return h.hexdigest()


class _TensorDigests:
    """Per-tensor BLAKE3s, fed the chunks of one sequential pass over a part."""

    def __init__(self, tensors: list[TensorInfo], head_len: int):
        self.spans = sorted(tensors, key=lambda t: t.offset)
        for a, b in zip(self.spans, self.spans[1:]):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(f"tensors {a.name} and {b.name} overlap")
        self.hashers = {t.name: blake3.blake3() for t in self.spans}
        self.head = bytearray()
        self.head_len = head_len

    def __call__(self, pos: int, chunk: memoryview) -> None:
        end = pos + len(chunk)
        if pos < self.head_len:
            self.head += chunk[:self.head_len - pos]
        for t in self.spans:
            lo, hi = max(pos, t.offset), min(end, t.offset + t.nbytes)
            if lo < hi:
                self.hashers[t.name].update(chunk[lo - pos:hi - pos])

    def digests(self) -> dict[str, bytes]:
        return {name: h.digest() for name, h in self.hashers.items()}


class OpenPart:
    """A part checked against its manifest BLAKE3 (`blake3_hex`; None reads it unchecked)
    and then read only through the descriptor it was checked on. `header` is the part's
    GGUF metadata and tensor index, parsed from the hashed bytes."""

    def __init__(self, directory: Path, file: str, size: int, blake3_hex: str | None):
        self.label = f"{directory}: part {file}"
        self._fd = open_part_file(directory, file, size)
        # The descriptor closes with this object even if nobody calls close().
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            self.header, self._digests = self._check(directory / file, size, blake3_hex)
        except GGUFError as e:
            self._closer()
            raise PackageError(f"{self.label} is not a readable GGUF ({e})") from None
        except PackageError:
            self._closer()
            raise

    def _check(self, path: Path, size: int,
               blake3_hex: str | None) -> tuple[GGUFFile, dict[str, bytes] | None]:
        # Where the header ends and the tensors lie, read once by path only to know what
        # to hash: everything used afterwards is parsed again from the hashed bytes.
        hint = GGUFFile(path)
        hint.close()
        if blake3_hex is None:
            head = bytearray(hint.data_start)
            read_at(self._fd, memoryview(head), 0, self.label)
            return GGUFFile.from_header(path, bytes(head), size), None
        seen = _TensorDigests(list(hint.tensors.values()), hint.data_start)
        if hash_fd(self._fd, size, self.label, sink=seen) != blake3_hex:
            raise PackageError(f"{self.label} is corrupted (BLAKE3 mismatch)")
        # The hashed bytes are the manifest's: a header that does not parse from them as
        # the hint did came from another file swapped in between.
        changed = PackageError(f"{self.label} changed while it was being checked")
        try:
            header = GGUFFile.from_header(path, bytes(seen.head), size)
        except GGUFError:
            raise changed from None
        if header.tensors != hint.tensors:
            raise changed
        return header, seen.digests()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, read from the checked descriptor into a new array; raises
        PackageError if they are not the bytes the check hashed."""
        info = self.header.tensors[name]
        out = np.empty(info.nbytes, dtype=np.uint8)
        read_at(self._fd, memoryview(out), info.offset, self.label)
        if self._digests is not None and \
                _new_hasher().update(out).digest() != self._digests[name]:
            raise PackageError(f"{self.label} changed after it was checked ({name} differs)")
        return out

    def close(self) -> None:
        if self._closer.alive:
            self._closer()
            self.header.close()
