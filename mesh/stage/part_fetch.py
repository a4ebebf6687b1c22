"""Package parts fetched from a node that holds them: verified, resumable, with progress.

A part arrives in 1 MiB blocks (proto/parts.proto). Each block is checked against the
BLAKE3 it was sent with before it is written; one damaged on the way is asked for again.
Verified blocks go to `<part>.partial` and their hashes to `<part>.blocks`, so a fetch cut
short (a dropped link, a restarted actor) resumes after the last block that still matches
its hash instead of starting over. The whole part must then match the manifest's BLAKE3,
or it is refused and removed; only then is it renamed into place, where a stage reads it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from blake3 import blake3

from skippy.cache.blocks import BLOCK_SIZE
from skippy.proto import parts_pb2 as pb
from skippy.proto import parts_pb2_grpc
from skippy.topology.model_package import PackageError, PartEntry
from skippy.topology.package_part import hash_fd, read_at
from skippy.topology.tally import Tally

from .channels import SilentPeer, channel_options, within_silence
from .part_service import MAX_MESSAGE
from .security import StageCredentials

log = logging.getLogger(__name__)

ATTEMPTS = 3        # a block damaged on the way is asked for this many times in all
SILENCE_S = 120.0   # a holder that sends nothing this long is given up on (the next one is asked)
_HASH = 32          # bytes of one block hash in <part>.blocks


class PartError(PackageError):
    """A part could not be fetched whole and verified from any holder."""


@dataclass
class Fetched:
    """What a fetch brought: bytes received, and blocks that arrived damaged."""
    bytes: int = 0
    damaged: int = 0
    resumed: int = 0   # bytes of a partial fetch kept from before


class PartFetcher:
    """Fetches parts of one model from the first of `holders` that has each."""

    def __init__(self, holders: Sequence[str], credentials: StageCredentials,
                 model_digest: str, silence_s: float = SILENCE_S):
        self.model_digest, self.silence_s = model_digest, silence_s
        self._metadata = credentials.metadata
        self._channels = [(a, credentials.channel(a, channel_options(MAX_MESSAGE)))
                          for a in holders]

    def fetch(self, part: PartEntry, into: Path, progress: Tally | None = None) -> Fetched:
        """`part` into `into/part.file`, whole and matching the manifest's BLAKE3; raises
        PartError if no holder gives it so (a wrong whole part is removed, not kept).
        `progress` counts the bytes as they arrive (those kept from an earlier fetch too)."""
        out = Fetched()
        partial = _Partial(into, part)
        why = "no holder was asked"
        try:
            for n, (address, channel) in enumerate(self._channels):
                kept = partial.resume()
                if n == 0:  # what a holder after the first keeps, it brought here
                    out.resumed = kept
                    if progress is not None:
                        progress.add(kept)
                try:
                    self._from(parts_pb2_grpc.PartsStub(channel), partial, out, progress)
                    partial.finish()
                    return out
                except grpc.RpcError as e:
                    why = f"{address}: {e.code().name} {e.details()}"
                except (PartError, SilentPeer) as e:
                    why = f"{address}: {e}"
                log.warning("part %s: %s", part.file, why)
        finally:
            partial.close()
        raise PartError(f"part {part.file}: {why}")

    def _from(self, stub, partial: _Partial, out: Fetched, progress: Tally | None) -> None:
        """Blocks from one holder until the part is complete; a damaged block is asked for
        again (from itself on), up to ATTEMPTS times."""
        tries = 0
        while not partial.complete:
            replies = stub.GetPart(pb.PartRequest(model_digest=self.model_digest,
                                                  file=partial.part.file,
                                                  first_block=partial.blocks),
                                   metadata=self._metadata)
            for block in within_silence(replies, self.silence_s):
                if block.index != partial.blocks or len(block.data) != partial.next_size:
                    replies.cancel()
                    raise PartError(f"block {block.index} is not the block asked for")
                if blake3(block.data).digest() != block.blake3:
                    out.damaged += 1
                    tries += 1
                    log.warning("part %s: block %d arrived damaged; asking again",
                                partial.part.file, block.index)
                    if tries >= ATTEMPTS:
                        replies.cancel()
                        raise PartError(f"block {block.index} arrived damaged "
                                        f"{ATTEMPTS} times")
                    replies.cancel()
                    break
                partial.write(block.data, block.blake3)
                out.bytes += len(block.data)
                if progress is not None:
                    progress.add(len(block.data))
            else:
                if not partial.complete:
                    raise PartError(f"the holder ended the part at block {partial.blocks}")

    def close(self) -> None:
        for _, channel in self._channels:
            channel.close()


class _Partial:
    """A part being fetched: verified blocks in <file>.partial, their hashes in
    <file>.blocks, block n written only after blocks 0..n-1."""

    def __init__(self, into: Path, part: PartEntry):
        self.part, self.final = part, into / part.file
        self.data_path = into / f"{part.file}.partial"
        self.hash_path = into / f"{part.file}.blocks"
        self.n_blocks = -(-part.size // BLOCK_SIZE)
        self.blocks = 0
        self._data = self._hashes = None
        into.mkdir(parents=True, exist_ok=True)

    @property
    def complete(self) -> bool:
        return self.blocks == self.n_blocks

    @property
    def next_size(self) -> int:
        return min(BLOCK_SIZE, self.part.size - self.blocks * BLOCK_SIZE)

    def resume(self) -> int:
        """Keep the leading blocks of an earlier fetch that still match their hashes (read
        back from disk: a block whose bytes never reached it fails, whatever reached it
        first); drop the rest. Returns the bytes kept."""
        self.close()
        hashes = self.hash_path.read_bytes() if self.hash_path.is_file() else b""
        self._data = open(self.data_path, "a+b")
        size = os.fstat(self._data.fileno()).st_size
        kept = 0
        for i in range(min(len(hashes) // _HASH, self.n_blocks)):
            n = min(BLOCK_SIZE, self.part.size - i * BLOCK_SIZE)
            if i * BLOCK_SIZE + n > size:
                break
            block = bytearray(n)
            read_at(self._data.fileno(), memoryview(block), i * BLOCK_SIZE, str(self.data_path))
            if blake3(block).digest() != hashes[i * _HASH:(i + 1) * _HASH]:
                break
            kept = i + 1
        self.blocks = kept
        self._data.truncate(min(kept * BLOCK_SIZE, self.part.size))
        self._hashes = open(self.hash_path, "a+b")
        self._hashes.truncate(kept * _HASH)
        return min(kept * BLOCK_SIZE, self.part.size)

    def write(self, data: bytes, digest: bytes) -> None:
        self._data.write(data)   # append mode: each block lands after the ones before
        self._hashes.write(digest)
        self.blocks += 1

    def finish(self) -> None:
        """Check the whole part against the manifest, then put it in place (synced)."""
        self._data.flush()
        fd = self._data.fileno()
        whole = hash_fd(fd, self.part.size, str(self.data_path))
        os.fsync(fd)
        self.close()
        if whole != self.part.blake3:
            self.data_path.unlink()
            self.hash_path.unlink()
            raise PartError(f"part {self.part.file} arrived whole with another BLAKE3 than "
                            "the manifest's: refused")
        os.replace(self.data_path, self.final)
        self.hash_path.unlink()
        dir_fd = os.open(self.final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        for fh in (self._data, self._hashes):
            if fh is not None:
                fh.close()
        self._data = self._hashes = None
