"""A stage's state shared with peer stages (other pipelines, other nodes) by hash.

`export` answers a peer's ask for the longest prefix this stage holds, as a payload
whose blocks wait in the block store for the peer to fetch; `adopt` takes a payload
pulled from a peer as a cache entry. The newest payloads stay (their blocks referenced)
so that a second asker, or this node's next pull of the same prefix, finds the blocks
here. Peers share prefixes of stride multiples.

Not thread-safe: owned by one StageCache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.identity import prefix_digest, prefix_digests
from skippy.cache.payload import PayloadManifest, release_payload

from .cache_policy import decode_state, encode_state
from .cache_scope import CacheScope
from .cache_tiers import RESTORE_ERRORS, CacheTiers
from .lanes import Lanes
from .runtime import StageError, StageRuntime

log = logging.getLogger(__name__)

# Payloads exported to peer stages or pulled from them, kept (newest last).
SHARED_PAYLOADS = 8


class PeerShare:
    def __init__(self, runtime: StageRuntime, tiers: CacheTiers, lanes: Lanes,
                 store: BlockStore, stride: int,
                 own_reuse: Callable[[int, Sequence[int], int, CacheScope], int]):
        """own_reuse(lane, tokens, max_len, scope): the rows a lane holds of `tokens`."""
        self.runtime, self.tiers, self.lanes, self.store = runtime, tiers, lanes, store
        self.stride, self._own_reuse = stride, own_reuse
        self._shared: dict[bytes, PayloadManifest] = {}  # prefix identity -> payload
        self.exports = self.adopted = 0

    def export(self, tokens: Sequence[int], limit: int, after: int,
               scope: CacheScope) -> PayloadManifest | None:
        """This stage's state for the longest prefix of `tokens` it holds, longer than
        `after` and at most `limit` tokens (a stride multiple), as a payload in the store
        that stays there for the asker to fetch; None when it holds nothing longer."""
        entries = self.tiers.entries
        if not entries.enabled:
            return None
        stride = self.stride
        lengths = list(range(min(limit, len(tokens)) // stride * stride, after, -stride))
        if not lengths:
            return None
        digests = prefix_digests(scope.key, tokens, lengths)
        for b in lengths:
            if digests[b] in self._shared:
                return self._share(self._shared.pop(digests[b]))
        self.tiers.expire_leases()
        lane, own = self._best_warm_lane(tokens, lengths[0], scope)
        hit = self.tiers.prefixes.lookup(scope.key, tokens, max_len=lengths[0])
        # a granular hit is cut to a stride multiple, where its state can be cut: never
        # recurrent state
        cut = 0 if hit is None else hit.length // stride * stride
        if hit is not None and cut != hit.length and entries.whole_entry:
            cut = 0
        try:
            if cut > max(own, after):
                manifest = entries.export(hit, cut, digests[cut])
            elif own > after:
                state = self.runtime.export_state(lane, own)
                manifest = encode_state(state, entries.kind_of(state), digests[own],
                                        self.tiers.stage_index, self.store, scope.key)
            else:
                return None
        except (BlockError, StageError, KeyError, ValueError, RuntimeError) as e:
            log.warning("stage %s: export failed: %s", self.tiers.stage_index, e)
            return None
        finally:
            self.tiers.release(hit)
        self.exports += 1
        return self._share(manifest)

    def _best_warm_lane(self, tokens, max_len: int, scope: CacheScope) -> tuple[int, int]:
        """(a warm lane, its rows reusable for `tokens`: a stride multiple, or 0)."""
        best = (-1, 0)
        for lane in self.lanes.warm_lanes():
            n = self._own_reuse(lane, tokens, max_len, scope)
            cut = n // self.stride * self.stride
            if cut != n and self.tiers.entries.whole_entry:
                cut = 0  # recurrent state exists only at the lane's end
            if cut > best[1]:
                best = (lane, cut)
        return best

    def adopt(self, tokens: Sequence[int], manifest: PayloadManifest,
              scope: CacheScope) -> bool:
        """Take a payload pulled from a peer stage (its blocks already in the store, one
        reference each, which pass to this cache) as an entry for its prefix. False,
        with its references released, when it is not this stage's state for these
        tokens: another identity (model, split, CPU kind, tenant) never enters."""
        n = manifest.n_tokens
        entries = self.tiers.entries
        if not entries.enabled or n > len(tokens) or \
                manifest.identity != prefix_digest(scope.key, tokens[:n]):
            release_payload(manifest, self.store)
            return False
        try:
            entries.adopt(tokens, decode_state(manifest, self.store), scope.key)
        except RESTORE_ERRORS as e:
            log.warning("stage %s: a pulled payload did not import: %s",
                        self.tiers.stage_index, e)
            release_payload(manifest, self.store)
            return False
        self.adopted += 1
        self._share(manifest)
        return True

    def _share(self, manifest: PayloadManifest) -> PayloadManifest:
        """Keep a payload (and the references it holds) as the newest shared one."""
        old = self._shared.pop(manifest.identity, None)
        if old is not None and old is not manifest:
            release_payload(old, self.store)
        self._shared[manifest.identity] = manifest
        while len(self._shared) > SHARED_PAYLOADS:
            release_payload(self._shared.pop(next(iter(self._shared))), self.store)
        return manifest

    def clear(self) -> None:
        for manifest in self._shared.values():
            release_payload(manifest, self.store)
        self._shared.clear()
