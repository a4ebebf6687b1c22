"""A stage's cache entries by tier, and the hits a plan pins until its restore.

RAM holds the family's entries (`cache_policy.py`: resident lanes or payloads); the disk
tier below it holds, as payloads, the resident entries RAM's caps push out, and a hit
there restores (and promotes) one instead of recomputing it. A lookup asks both and takes
a hit only where its restore is measured cheaper than computing the rows it saves
(`cache/restore_cost.py`: "never restore when recompute is cheaper"). A hit a plan
reports is leased to the lane (`leases.py`) until the restore consumes it.

Not thread-safe: owned by one StageCache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.config import CacheConfig
from skippy.cache.index import STEM_TOKENS
from skippy.cache.payload import IncompatiblePayload
from skippy.cache.prefix_cache import Hit, PrefixCache
from skippy.cache.restore_cost import RestoreCosts

from .cache_policy import CachePolicy, ResidentLanes, StoredPayloads
from .cache_scope import CacheScope
from .leases import Lease, Leases
from .runtime import StageError, StageRuntime

log = logging.getLogger(__name__)

# The disk tier's hits count under this kind; it holds at most this many entries.
COLD = "cold"
COLD_ENTRIES = 4096
# What a failed restore or import may raise (RuntimeError: a runtime that refused the
# state, llama.cpp's LlamaCppError): the entry is dropped and the rows recomputed.
RESTORE_ERRORS = (BlockError, IncompatiblePayload, StageError, KeyError, ValueError,
                  RuntimeError)


class CacheTiers:
    def __init__(self, runtime: StageRuntime, config: CacheConfig, cls: type[CachePolicy],
                 store: BlockStore, cold_store: BlockStore | None, stage_index: int,
                 granular: bool, leases: Leases):
        """cls: the family's policy class; granular: hits may end at any token
        (row-invariant stages) rather than at stride multiples."""
        self.runtime, self.config, self.granular = runtime, config, granular
        self.prefixes = self._prefixes(cls, cls.name, config.max_entries, config.max_bytes)
        self.stage_index = index = stage_index
        self.entries: CachePolicy = cls(runtime, self.prefixes, store, index)
        self.cold: CachePolicy | None = None
        if cold_store is not None and config.cold_max_bytes and self.entries.enabled:
            # entries there are payloads, whole ones where the family's state is recurrent
            tier = StoredPayloads if cls is ResidentLanes else cls
            self.cold = tier(runtime, self._prefixes(cls, COLD, COLD_ENTRIES,
                                                     config.cold_max_bytes),
                             cold_store, index)
            self.entries.demote = lambda scope, tokens, state: \
                self.cold.adopt(tokens, state, scope)
        self.leases = leases
        self.costs = RestoreCosts()
        self.failures = 0   # restores that failed after a plan: each one a recompute

    def _prefixes(self, cls: type[CachePolicy], kind: str, entries: int,
                  nbytes: int) -> PrefixCache:
        c = self.config
        return PrefixCache(block=c.stride, max_entries=entries, max_bytes=nbytes,
                           max_tokens=c.max_tokens_per_entry, kind=kind,
                           whole_entry=cls.whole_entry, granular=self.granular)

    # -- lookup ------------------------------------------------------------------------------
    def best(self, tokens: Sequence[int], max_len: int, own: int,
             scope: CacheScope) -> tuple[int, Hit | None]:
        """(the longest reusable prefix <= max_len, the pinned hit that provides it, or
        None when the lane's own `own` rows do)."""
        # hits that run to the token may be a short stem (a system prompt under a block)
        shortest = STEM_TOKENS if self.granular else self.config.min_prefix
        if not self.entries.enabled or scope.probe or max_len < shortest:
            return own, None
        hits = [self.prefixes.lookup(scope.key, tokens, max_len=max_len)]
        top = max_len if self.granular else max_len // self.config.stride * self.config.stride
        if self.cold is not None and (hits[0] is None or hits[0].length < top):
            # a longer prefix on disk may beat a shorter one in RAM
            hits.append(self.cold.prefixes.lookup(scope.key, tokens, max_len=max_len))
        best = None
        for hit in sorted((h for h in hits if h is not None), key=lambda h: -h.length):
            if best is None and hit.length > own and \
                    self.costs.pays(hit.kind, hit.length, hit.length - own):
                best = hit
            else:
                self.release(hit)
        return (own, None) if best is None else (best.length, best)

    def release(self, hit: Hit | None) -> None:
        """Unpin a hit; an entry removed while pinned is freed now."""
        if hit is not None:
            tier = self._tier(hit)
            tier.drop(tier.prefixes.release(hit))

    def _tier(self, hit: Hit) -> CachePolicy:
        """Whose entry a hit is: RAM's, or the disk tier's."""
        return self.cold if hit.kind == COLD and self.cold is not None else self.entries

    # -- leases ------------------------------------------------------------------------------
    def lease(self, lane: int, hit: Hit, scope: CacheScope, tokens: Sequence[int]) -> None:
        self.leases.grant(lane, hit, scope.key, tokens)

    def expire_leases(self) -> None:
        """Release the hits of plans whose restore never came in time."""
        for lease in self.leases.take_expired():
            self.release_lease(lease)

    def take_lease(self, lane: int) -> Lease | None:
        """The lane's lease, if any (expired ones released first): the caller's now."""
        self.expire_leases()
        return self.leases.take(lane)

    def release_lease(self, lease: Lease | None) -> None:
        if lease is not None:
            self.release(lease.hit)

    def end_lease(self, lane: int) -> None:
        self.release_lease(self.take_lease(lane))

    # -- restore -----------------------------------------------------------------------------
    def restore(self, lane: int, tokens: Sequence[int], start: int, scope: CacheScope,
                lease: Lease | None) -> bool:
        """Make `lane` hold the state of tokens [0, start) from the hit `lease` pinned
        (else a fresh lookup). False: it could not (a corrupt block, an unplanned start
        whose entry went away); the entry, if bad, is dropped."""
        if lease is not None and lease.serves(scope.key, tokens, start):
            hit = lease.hit
        else:
            self.release_lease(lease)
            hit = self.prefixes.lookup(scope.key, tokens, max_len=start)
        if self._restore_hit(lane, hit, tokens, start, scope):
            return True
        self.failures += 1
        return False

    def _restore_hit(self, lane: int, hit: Hit | None, tokens: Sequence[int], start: int,
                     scope: CacheScope) -> bool:
        """Restore a pinned hit (released here, whatever happens)."""
        if hit is None or hit.length != start:
            self.release(hit)
            return False
        tier = self._tier(hit)
        try:
            t = time.perf_counter()
            tier.restore(lane, hit, start)
            self.costs.restored(hit.kind, start, time.perf_counter() - t)
            if tier is self.cold:  # promoted: RAM holds it again
                self.entries.adopt(tokens[:start], self.runtime.export_state(lane, start),
                                   scope.key)
            return True
        except RESTORE_ERRORS as e:
            log.warning("stage %s: dropping cache entry %s after a failed restore: %s",
                        self.stage_index, hit.entry_id, e)
            tier.prefixes.remove(hit.entry_id)
            return False
        finally:
            self.release(hit)

    def clear(self) -> None:
        """Forget every entry; one leased to a lane is freed when its lease ends."""
        self.entries.drop(self.prefixes.clear())
        if self.cold is not None:
            self.cold.drop(self.cold.prefixes.clear())
