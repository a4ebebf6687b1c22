"""Pulling a prefix's state from a peer stage: another pipeline's cache becomes this one's.

When the router sends a request to a pipeline other than the one that served its prefix,
every stage is told where its counterpart in that pipeline listens (`Plan.peers`). A stage
whose own caches hold less asks the peer to export the longest prefix it holds (`Export`),
fetches only the blocks its store lacks (`GetBlocks`, each checked against its BLAKE3 hash)
and adopts the payload as a cache entry, which the plan then finds like any local hit.

It pulls only when that is expected to beat recomputing: the bytes it lacks over the
link's measured bandwidth, plus decoding the payload, against this stage's measured
prefill seconds per row. Any failure (the peer gone, a block missing, another identity)
leaves the request to recompute: a pull can make a request faster, never different.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from skippy.cache.blocks import BlockError, StoreFull

from .block_fetch import BlockPeer
from .security import StageCredentials

log = logging.getLogger(__name__)

LINK_BYTES_PER_S = 100e6    # assumed before the first fetch from a peer is measured
DECODE_BYTES_PER_S = 1e9    # laying a payload's blocks out as tensors (measured ~2 GB/s)
SMOOTHING = 0.5             # weight of the newest bandwidth measure


def peer_named(server, plan) -> str | None:
    """Where the stage's counterpart that `plan` names to pull from listens (another
    pipeline served a longer prefix), if anywhere."""
    i = server.spec.stage_index
    if plan.probe or server.puller is None or i >= len(plan.peers) or not plan.peers[i]:
        return None
    return plan.peers[i]


def start_pull(server, peer: str, lane: int, plan) -> threading.Thread:
    """The pull of `plan`'s prompt from `peer` into `lane`, on a thread of its own."""
    t = threading.Thread(target=server.puller.pull, daemon=True, args=(
        server, peer, lane, list(plan.tokens), plan.limit, plan.namespace))
    t.start()
    return t


class StatePuller:
    def __init__(self, credentials: StageCredentials, max_message: int):
        self._credentials, self._max_message = credentials, max_message
        self._peers: dict[str, BlockPeer] = {}
        self._lock = threading.Lock()
        self.bandwidth: dict[str, float] = {}  # peer address -> measured bytes/s
        self.counts = {"pulls": 0, "skipped": 0, "failed": 0, "fetched_bytes": 0,
                       "held_bytes": 0, "pulled_tokens": 0}

    def pull(self, server, address: str, lane: int, tokens: Sequence[int], limit: int,
             namespace: str) -> int:
        """Tokens of `tokens` this stage's cache gained from the peer at `address` (0 when
        it held as much, the pull would not pay, or it failed)."""
        loop, cache = server.loop, server.cache
        try:
            scope = cache.scope(namespace)
            have = loop.call(cache.available, lane, tokens, limit, scope)
            peer = self._peer(address)
            manifest = peer.export(list(tokens), limit, have, namespace)
            if manifest is None:
                return 0
            gain = manifest.n_tokens - have
            missing = {h for h in manifest.blocks if not cache.store.has(h)}
            lacking = manifest.total_bytes * len(missing) / max(len(manifest.blocks), 1)
            if not self._pays(address, lacking, manifest.total_bytes, gain,
                              loop.timing.prefill_s_per_row()):
                self._count(skipped=1)
                return 0
            t = time.perf_counter()
            got = peer.fetch(manifest.blocks, cache.store)
            if got.missing:
                self._count(failed=1)
                log.warning("pull from %s: %d block(s) missing; recomputing", address,
                            len(got.missing))
                return 0
            if got.bytes:
                self._measured(address, got.bytes / max(time.perf_counter() - t, 1e-6))
            if not _take(cache.store, manifest.blocks, got.blocks):
                self._count(failed=1)
                return 0
            if not loop.call(cache.peers.adopt, tokens, manifest, scope):
                self._count(failed=1)
                return 0
            self._count(pulls=1, fetched_bytes=got.bytes, pulled_tokens=gain,
                        held_bytes=manifest.total_bytes - got.bytes)
            return gain
        except Exception as e:  # a pull never fails the request
            log.warning("pull from %s failed: %s", address, e)
            self._count(failed=1)
            return 0

    def _pays(self, address: str, lacking: float, total: int, gain: int,
              s_per_row: float | None) -> bool:
        if gain <= 0:
            return False
        if s_per_row is None:  # nothing measured here yet: a pull is the better bet
            return True
        fetch_s = lacking / self.bandwidth.get(address, LINK_BYTES_PER_S) + \
            total / DECODE_BYTES_PER_S
        return fetch_s < gain * s_per_row

    def _peer(self, address: str) -> BlockPeer:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = BlockPeer(address, self._credentials,
                                                        self._max_message)
            return peer

    def _measured(self, address: str, rate: float) -> None:
        with self._lock:
            old = self.bandwidth.get(address)
            self.bandwidth[address] = rate if old is None else \
                SMOOTHING * rate + (1 - SMOOTHING) * old

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()


def _take(store, blocks: Sequence[bytes], fetched: dict[bytes, bytes]) -> bool:
    """One reference on each of a payload's blocks (a block used twice, twice): fetched
    ones are put, ones held here retained (or linked, where another stage of the node
    holds them). False, with nothing kept, if a held block went away meanwhile."""
    taken = []
    try:
        for h in blocks:
            if store.refs(h) and h not in fetched:
                store.retain(h)
            else:
                store.put(fetched[h] if h in fetched else store.get(h))
            taken.append(h)
        return True
    except (BlockError, StoreFull):
        for h in taken:
            store.release(h)
        return False
