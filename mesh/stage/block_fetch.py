"""Blocks fetched from a peer stage by hash: exported state shared between nodes.

A stage that lacks blocks another node holds asks that node's stage for them (`GetBlocks`,
over the authenticated stage network) and keeps only bytes whose BLAKE3 is the hash it
asked for. A block damaged in transit, or one the holder has lost, is asked for again,
then reported missing: the caller recomputes instead. Blocks already held here are never
asked for, so each host fetches a shared block at most once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from blake3 import blake3

from skippy.cache.blocks import BlockStore
from skippy.cache.payload import IncompatiblePayload, PayloadManifest
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc

from .channels import SilentPeer, channel_options, within_silence
from .security import StageCredentials

ATTEMPTS = 2       # a block that arrives damaged is asked for once more
SILENCE_S = 60.0   # a holder that sends nothing this long is given up on: recompute
EXPORT_S = 10.0    # a peer that cannot export a prefix in this long is not worth waiting for


@dataclass
class Fetch:
    """What one fetch brought: verified blocks by hash, what it could not get, and what
    it skipped because this host's store holds it already."""
    blocks: dict[bytes, bytes] = field(default_factory=dict)
    missing: list[bytes] = field(default_factory=list)
    held: int = 0          # hashes the local store already had
    damaged: int = 0       # blocks that arrived with other bytes than their hash

    @property
    def bytes(self) -> int:
        return sum(len(b) for b in self.blocks.values())


class BlockPeer:
    """The stage of another node, asked for blocks over one channel."""

    def __init__(self, address: str, credentials: StageCredentials, max_message: int,
                 silence_s: float = SILENCE_S):
        self.address, self.silence_s = address, silence_s
        self._channel = credentials.channel(address, channel_options(max_message))
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._metadata = credentials.metadata

    def export(self, tokens: list[int], limit: int, after: int,
               namespace: str = "") -> PayloadManifest | None:
        """The peer's payload for the longest prefix of `tokens` it holds (longer than
        `after`, at most `limit`); None when it holds nothing longer or answers with
        something that is not a manifest. Raises ConnectionError when it cannot be
        reached."""
        try:
            reply = self._stub.Export(pb.ExportRequest(tokens=tokens, limit=limit, after=after,
                                                       namespace=namespace),
                                      metadata=self._metadata, timeout=EXPORT_S)
        except grpc.RpcError as e:
            raise ConnectionError(f"peer {self.address}: {e.code().name}") from None
        if not reply.manifest:
            return None
        try:
            return PayloadManifest.from_bytes(reply.manifest)
        except IncompatiblePayload:
            return None

    def fetch(self, hashes: Iterable[bytes], local: BlockStore | None = None) -> Fetch:
        """The blocks of `hashes` that `local` lacks, verified; the holder's absence or a
        broken stream leaves them in `missing` rather than raising."""
        out, wanted = Fetch(), []
        for h in dict.fromkeys(hashes):  # each hash once, in order
            if local is not None and local.has(h):
                out.held += 1
            else:
                wanted.append(h)
        for _ in range(ATTEMPTS):
            if not wanted:
                break
            wanted = self._ask(wanted, out)
        out.missing = wanted
        return out

    def _ask(self, wanted: list[bytes], out: Fetch) -> list[bytes]:
        """One GetBlocks round: the hashes still wanted after it."""
        left = dict.fromkeys(wanted)
        try:
            replies = self._stub.GetBlocks(pb.BlockRequest(hashes=wanted),
                                           metadata=self._metadata)
            for block in within_silence(replies, self.silence_s):
                if block.hash not in left or not block.data:
                    continue  # not asked, or the holder no longer has it
                if blake3(block.data).digest() != block.hash:
                    out.damaged += 1
                    continue
                out.blocks[block.hash] = block.data
                del left[block.hash]
        except (grpc.RpcError, SilentPeer):
            pass  # the holder went away or fell silent: what arrived is kept, the rest is missing
        return list(left)

    def close(self) -> None:
        self._channel.close()
