"""A stage's exact caches: the adapter between cache/ (pure decisions) and a runtime.

One `StageCache` per stage. It answers how much of a request's prefix this stage can
reuse, restores that state into the request's lane, runs the prefill, and records new
entries. What differs by policy (how entries are held, recorded, restored, dropped) is a
policy object chosen once (`cache_policy.py`); the request lanes and the warm ones kept
for follow-ups are `lanes.py`'s. A lane that still holds the prefix itself (the hot lane)
continues from its own state: no copy, no admission.

- Activation frames (non-final stages): the rows [0, b) this stage sent downstream for
  an admitted prefix. When this stage can start at b but the next one must start
  earlier, rows [d, b) come from here instead of being recomputed.

The caller plans from the last stage back (`plan`: where each stage starts, given where
the next one starts), restores, then prefills from stage 0 on. A plan that counts on a
cache entry pins it (a lease, `leases.py`) until the restore, so no eviction in between
can take it. Any failure to restore is reported, never raised: the caller recomputes. A
cache can make a request faster, never different and never failed.

Not thread-safe: a stage makes its runtime and cache calls one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from skippy.cache.activation import ActivationCache
from skippy.cache.admission import PrefixAdmission
from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.config import CacheConfig
from skippy.cache.identity import StageKey, page_id, prefix_digest, prefix_digests
from skippy.cache.payload import IncompatiblePayload, PayloadManifest, release_payload
from skippy.cache.prefix_cache import Hit, PrefixCache
from skippy.cache.restore_cost import RestoreCosts
from skippy.cache.results import ExactResults
from skippy.cache.telemetry import merge

from .cache_policy import (CachePolicy, ResidentLanes, StoredPayloads, decode_state,
                           encode_state, policy_class)
from .frame import Frame
from .lanes import Lanes
from .leases import Lease, Leases
from .runtime import StageError, StageOutput, StageRuntime
from .stage_spec import Exactness

log = logging.getLogger(__name__)

# Finished requests' lanes kept warm, on runtimes whose lanes are unlimited (each holds
# memory). A fixed-lane runtime (llama.cpp) keeps every idle lane warm until it is needed.
WARM_LANES = 4
# A plan's lease on its hit ends this long after the plan if no restore consumed it.
LEASE_SECONDS = 30.0
# The disk tier's hits count under this kind; it holds at most this many entries.
COLD = "cold"
COLD_ENTRIES = 4096
# Payloads exported to peer stages or pulled from them, kept (newest last) so that a
# second asker, or this node's next pull of the same prefix, finds the blocks here.
SHARED_PAYLOADS = 8


def stage_key_for(runtime: StageRuntime, topology_digest: str = "",
                  namespace: str = "") -> StageKey:
    """The token-independent identity of a runtime's stage (DESIGN.md §5.1)."""
    ident = runtime.identity()
    layer_range = ident["layer_range"]
    return StageKey(
        model_digest=str(ident.get("weights_digest", "")),
        topology_digest=topology_digest,
        stage_index=int(ident["stage_index"]),
        layer_start=int(layer_range[0]),
        layer_end=int(layer_range[1]),
        runtime_abi=str(ident["runtime_abi"]),
        kv_layout=str(ident.get("kv_layout", "")),
        kv_dtype=str(ident.get("kv_dtype", "")),
        wire_dtype=str(ident.get("wire_dtype", "")),
        n_ctx=int(ident["n_ctx"]),
        rope=tuple(ident.get("rope", ())),
        numeric_policy=tuple(sorted(ident.get("numeric_policy", {}).items())),
        namespace=namespace,
    )


class StageCache:
    def __init__(self, runtime: StageRuntime, config: CacheConfig, *, policy: str,
                 stage_key: StageKey | None = None, store: BlockStore | None = None,
                 cold_store: BlockStore | None = None,
                 lease_seconds: float = LEASE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        """policy: the family's cache policy name (cache_policy.POLICIES); a disabled
        config turns it off. cold_store: the node's disk store, for the disk tier
        (config.cold_max_bytes). lease_seconds: how long a plan's hit stays pinned
        without a restore."""
        cls = policy_class(policy, runtime, config.enabled)
        if config.chunk != runtime.spec.chunk:
            raise ValueError(f"cache chunk {config.chunk} differs from the runtime's "
                             f"{runtime.spec.chunk}")
        self.runtime, self.config = runtime, config
        self.policy = cls.name
        self.key = stage_key or stage_key_for(runtime, runtime.spec.topology_digest)
        self.stage = self.key.digest
        # Row-invariant stages reuse to the token (DESIGN.md §5.3): entries hold whole
        # prompts and turns, and a KV hit may end at any token (recurrent state: at an
        # entry's end, wherever that is).
        self.granular = runtime.exactness is Exactness.ROW_INVARIANT
        self.prefixes = PrefixCache(block=config.stride, max_entries=config.max_entries,
                                    max_bytes=config.max_bytes,
                                    max_tokens=config.max_tokens_per_entry, kind=cls.name,
                                    whole_entry=cls.whole_entry, granular=self.granular)
        self.admission = PrefixAdmission(config.admit_after)
        # Every policy's state can travel between nodes as payloads, so every stage has a
        # store: entries live there for payload policies, shared payloads for all.
        self.store = store if store is not None else BlockStore(config.block_store_max_bytes)
        self.entries: CachePolicy = cls(runtime, self.prefixes, self.store,
                                        self.key.stage_index)
        # The disk tier: resident entries the RAM caps push out are demoted to payloads
        # there, and a hit restores (and promotes) one instead of recomputing it.
        self.cold: CachePolicy | None = None
        if cold_store is not None and config.cold_max_bytes and self.entries.enabled:
            # entries there are payloads, whole ones where the family's state is recurrent
            tier = StoredPayloads if cls is ResidentLanes else cls
            self.cold = tier(runtime, PrefixCache(
                block=config.stride, max_entries=COLD_ENTRIES, max_bytes=config.cold_max_bytes,
                max_tokens=config.max_tokens_per_entry, kind=COLD,
                whole_entry=cls.whole_entry, granular=self.granular), cold_store,
                self.key.stage_index)
            self.entries.demote = lambda scope, tokens, state: \
                self.cold.adopt(tokens, state, scope)
        self.lanes = Lanes(runtime, WARM_LANES if runtime.lane_entries else None,
                           keep=self._keep_lane if self.granular else None)
        self.leases = Leases(lease_seconds, clock)
        self.restore_failures = 0   # restores that failed after a plan: recomputed
        self.costs = RestoreCosts()  # a hit is taken only where its restore pays
        self.results = ExactResults(config.max_entries, config.activation_max_bytes) \
            if runtime.spec.is_last else None
        self.frames = ActivationCache(config.activation_max_entries,
                                      config.activation_max_bytes) \
            if not runtime.spec.is_last and config.activation_max_bytes else None
        self._width = runtime.cfg.hidden if self.frames is not None else 0  # frame row width
        self._scopes: dict[str, bytes] = {"": self.stage}
        # prefix identity -> payload, oldest first
        self._shared: dict[bytes, PayloadManifest] = {}
        self.exports = self.adopted = 0

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self, tokens: Sequence[int] = (), namespace: str = "") -> int:
        """A lane for a request: the warm lane holding the longest reusable prefix of its
        tokens (a follow-up continues in place, nothing copied), else a fresh lane. A
        runtime out of lanes gives up its oldest warm lane. (Cache entries hold lanes
        only on runtimes whose lanes are unlimited, so they never keep one from a
        request.)"""
        self._expire_leases()
        return self.lanes.alloc(lambda lane: self._own_reuse(lane, tokens, len(tokens),
                                                             namespace))

    def free_lane(self, lane: int, *, keep_warm: bool = False) -> None:
        """The request is over; its lease, if any, ends. `keep_warm`: the lane keeps its
        rows for a follow-up (never for a probe's rows, which bypass every cache)."""
        self._end_lease(lane)
        self.lanes.release(lane, keep_warm=keep_warm and self.entries.enabled)

    def _keep_lane(self, lane: int, info) -> bool:
        """A warm lane pushed out: its rows, a reply's included, become a cache entry
        (the lane itself, no copy) so that the conversation's next turn still finds
        them. False: the entries did not take it."""
        n = min(len(info.tokens), self.runtime.lane_length(lane))
        return self.entries.keep_lane(lane, info.tokens[:n], self.scope(info.namespace))

    def drop_warm_lanes(self, keep: int = 0) -> None:
        """Free warm lanes, oldest first, down to `keep` (0: later hits must come from
        the cache entries)."""
        self.lanes.drop_warm(keep)

    def scope(self, namespace: str = "") -> bytes:
        """The stage digest entries are keyed under: one per tenant namespace, so that
        one tenant never hits (or times) another's prefixes."""
        s = self._scopes.get(namespace)
        if s is None:
            s = self._scopes[namespace] = dataclasses.replace(self.key,
                                                              namespace=namespace).digest
        return s

    # -- planning --------------------------------------------------------------------------
    def plan(self, lane: int, tokens: Sequence[int], limit: int, downstream: int | None, *,
             probe: bool = False, namespace: str = "") -> int:
        """Where this stage starts its prefill, given that the next stage needs rows from
        `downstream` (None at the last stage). Rows [downstream, start) are then served
        from the frame cache; without them the stage starts no later than `downstream`.
        When the start comes from a cache entry, the entry is leased to the lane (pinned)
        until `restore` consumes it, or a new plan, a prefill, `free_lane` or expiry
        ends the lease."""
        self._expire_leases()
        self._end_lease(lane)
        best, hit = self._best(lane, tokens, limit, probe, namespace)
        if downstream is not None and downstream < best and \
                self._cached_frame(tokens, best, probe, namespace) is None:
            self._release(hit)
            best, hit = self._best(lane, tokens, downstream, probe, namespace)
        if hit is not None:
            self.leases.grant(lane, hit, self.scope(namespace), tokens)
        return best

    def available(self, lane: int, tokens: Sequence[int], max_len: int, *,
                  probe: bool = False, namespace: str = "") -> int:
        """The longest chunk-aligned prefix (<= max_len) this stage could restore for
        `tokens` into `lane`: its own rows, or a cache entry. Pins nothing."""
        best, hit = self._best(lane, tokens, max_len, probe, namespace)
        self._release(hit)
        return best

    def _best(self, lane: int, tokens: Sequence[int], max_len: int, probe: bool,
              namespace: str) -> tuple[int, Hit | None]:
        """(longest reusable prefix, the pinned hit that provides it or None when the
        lane's own rows do)."""
        own = self._own_reuse(lane, tokens, max_len, namespace)
        if not self.entries.enabled or probe or max_len < self.config.min_prefix:
            return own, None
        scope = self.scope(namespace)
        hits = [self.prefixes.lookup(scope, tokens, max_len=max_len)]
        top = max_len if self.granular else max_len // self.config.stride * self.config.stride
        if self.cold is not None and (hits[0] is None or hits[0].length < top):
            # a longer prefix on disk may beat a shorter one in RAM
            hits.append(self.cold.prefixes.lookup(scope, tokens, max_len=max_len))
        best = None
        for hit in sorted((h for h in hits if h is not None), key=lambda h: -h.length):
            if best is None and hit.length > own and \
                    self.costs.pays(hit.kind, hit.length, hit.length - own):
                best = hit
            else:
                self._release(hit)
        return (own, None) if best is None else (best.length, best)

    def _own_reuse(self, lane: int, tokens: Sequence[int], max_len: int,
                   namespace: str = "") -> int:
        info = self.lanes.info(lane)
        if info.namespace != namespace:
            return 0
        held = info.tokens
        n = min(len(held), max_len)
        i = 0
        while i < n and held[i] == tokens[i]:
            i += 1
        return self.entries.own_reuse(lane, self.runtime.resume_point(lane, i, len(tokens)))

    def restore(self, lane: int, tokens: Sequence[int], start: int, *,
                namespace: str = "") -> bool:
        """Make `lane` hold this stage's state for tokens [0, start), from the entry its
        plan leased (else a fresh lookup). False: it could not (a corrupt block, an
        unplanned start whose entry went away): the caller recomputes from 0."""
        self._expire_leases()
        lease = self.leases.take(lane)
        if start == 0 or self._own_reuse(lane, tokens, start, namespace) == start:
            self._release_lease(lease)
            return True  # nothing to restore, or the hot lane already holds it
        scope = self.scope(namespace)
        if lease is not None and lease.serves(scope, tokens, start):
            hit = lease.hit
        else:
            self._release_lease(lease)
            hit = self.prefixes.lookup(scope, tokens, max_len=start)
        if self._restore_hit(lane, hit, tokens, start, namespace):
            return True
        self.restore_failures += 1
        return False

    def _restore_hit(self, lane: int, hit: Hit | None, tokens: Sequence[int], start: int,
                     namespace: str) -> bool:
        """Restore a pinned hit (released here, whatever happens)."""
        if hit is None or hit.length != start:
            self._release(hit)
            return False
        tier = self._tier(hit)
        try:
            t = time.perf_counter()
            tier.restore(lane, hit, start)
            self.costs.restored(hit.kind, start, time.perf_counter() - t)
            self.lanes.hold(lane, tokens[:start], namespace)
            if tier is self.cold:  # promoted: RAM holds it again
                self.entries.adopt(tokens[:start], self.runtime.export_state(lane, start),
                                   self.scope(namespace))
            return True
        except (BlockError, IncompatiblePayload, StageError, KeyError, ValueError,
                RuntimeError) as e:
            # RuntimeError: the runtime refused the state (llama.cpp's LlamaCppError)
            log.warning("stage %s: dropping cache entry %s after a failed restore: %s",
                        self.key.stage_index, hit.entry_id, e)
            tier.prefixes.remove(hit.entry_id)
            return False
        finally:
            self._release(hit)

    def _tier(self, hit: Hit) -> CachePolicy:
        """Whose entry a hit is: RAM's, or the disk tier's."""
        return self.cold if hit.kind == COLD and self.cold is not None else self.entries

    # -- leases ----------------------------------------------------------------------------
    def _end_lease(self, lane: int) -> None:
        self._release_lease(self.leases.take(lane))

    def _expire_leases(self) -> None:
        for lease in self.leases.take_expired():
            self._release_lease(lease)

    def _release_lease(self, lease: Lease | None) -> None:
        if lease is not None:
            self._release(lease.hit)

    def _release(self, hit: Hit | None) -> None:
        """Unpin a hit; an entry removed while pinned is freed now."""
        if hit is not None:
            tier = self._tier(hit)
            tier.drop(tier.prefixes.release(hit))

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, lane: int, tokens: Sequence[int], inputs, start: int,
                logits: str = "last", *, probe: bool = False, namespace: str = "",
                downstream: int | None = None,
                between_chunks: Callable[[], None] | None = None) -> StageOutput:
        """Prefill tokens [start, n) (inputs are ids for stage 0, a Frame otherwise) on a
        lane that holds [0, start), then record what was admitted. A non-final stage's
        frame covers rows [downstream, n) (default: [start, n)): rows before `start`
        come from the frame cache (the plan made sure they are there). A lease the lane
        still holds ends here: its restore was skipped."""
        self._expire_leases()
        self._end_lease(lane)
        n = len(tokens)
        scope = self.scope(namespace)
        boundaries = self._admitted(tokens, start, probe, scope)
        t = time.perf_counter()
        out = self.runtime.prefill(lane, inputs, start, logits,
                                   snapshots=self.entries.snapshots(boundaries),
                                   between_chunks=between_chunks)
        self.costs.prefilled(n - start, time.perf_counter() - t)
        self.lanes.hold(lane, tokens[:n], namespace)
        self.entries.record(lane, tokens, boundaries, out, scope)
        if out.frame is not None:
            out.frame = self._frames_after_prefill(tokens, start, out.frame, boundaries,
                                                   probe, namespace, downstream)
        return out

    def _frames_after_prefill(self, tokens, start: int, frame: Frame, boundaries: list[int],
                              probe: bool, namespace: str, downstream: int | None) -> Frame:
        """Record the admitted frames; the frame to send: rows [downstream, n)."""
        n = len(tokens)
        earlier = None
        if start and (boundaries or (downstream is not None and downstream < start)):
            earlier = self._cached_frame(tokens, start, probe, namespace)
        whole = _join(earlier, frame, start)  # rows [0, n) when the cache had [0, start)
        if boundaries and whole is not None:
            self._record_frames(tokens, boundaries, whole, self.scope(namespace))
        if downstream is None or downstream == start:
            return frame
        if downstream > start:
            return _rows(frame, downstream, n)
        if whole is None:
            raise StageError(f"no cached frame rows [{downstream}, {start})")
        return _rows(whole, downstream, n)

    def note_decoded(self, lane: int, tokens: Sequence[int]) -> None:
        """A decode step appended rows (a verify step's proposed tokens too): reused by a
        later prefill where the runtime keeps the row-invariant contract, never on a
        chunked one (DESIGN.md §5.3)."""
        self.lanes.info(lane).tokens.extend(int(t) for t in tokens)

    def rewind(self, lane: int, n_tokens: int) -> None:
        """The lane back to its first n_tokens (a verify step's rejected rows dropped)."""
        self.runtime.rewind(lane, n_tokens)
        del self.lanes.info(lane).tokens[n_tokens:]

    def _admitted(self, tokens, start: int, probe: bool, scope: bytes) -> list[int]:
        """Boundaries past the restored start that have now been seen often enough."""
        if not self.entries.enabled or probe:
            return []
        limit = len(tokens) // self.runtime.spec.chunk * self.runtime.spec.chunk
        candidates = [b for b in self.config.record_lengths(len(tokens)) if start < b <= limit]
        return [b for b in candidates
                if self.admission.observe(prefix_digest(scope, tokens[:b]))]

    # -- activation frames (non-final stages) ------------------------------------------------
    def _frame_key(self, scope: bytes, tokens, b: int) -> str:
        return page_id(prefix_digest(scope, tokens[:b]))

    def _cached_frame(self, tokens, start: int, probe: bool, namespace: str) -> Frame | None:
        """Rows [0, L) for some recorded L >= start, cut to [0, start); None if absent."""
        if self.frames is None or not self.entries.enabled or probe or not start:
            return None
        scope, width = self.scope(namespace), self._width
        lengths = sorted({start, *(b for b in self.config.record_lengths(len(tokens))
                                   if b > start)})
        for b in lengths:
            frame = self.frames.get_frame(self._frame_key(scope, tokens, b), width)
            if frame is not None:
                return _rows(frame, 0, start)
        return None

    def _record_frames(self, tokens, boundaries: list[int], whole: Frame,
                       scope: bytes) -> None:
        """Keep rows [0, b) at the longest admitted boundary (shorter ones are cut from it)."""
        b = max(boundaries)
        if self.frames is None or whole.end < b:
            return
        frame = _rows(whole, 0, b)
        nbytes = frame.rows.numel() * frame.rows.element_size() + (
            0 if frame.scale is None else frame.scale.numel() * 4)
        self.frames.put_frame(self._frame_key(scope, tokens, b), self._width,
                              frame, nbytes)

    # -- exact results (last stage) ----------------------------------------------------------
    def cached_result(self, tokens: Sequence[int], *, probe: bool = False,
                      namespace: str = ""):
        if self.results is None or not self.entries.enabled:
            return None
        return self.results.get_result(self.scope(namespace), tokens, probe=probe)

    def remember_result(self, tokens: Sequence[int], logits: torch.Tensor, *,
                        probe: bool = False, namespace: str = "") -> None:
        if self.results is None or not self.entries.enabled or probe:
            return
        value = logits.clone()
        self.results.put_result(self.scope(namespace), tokens, value,
                                value.numel() * value.element_size())

    # -- state shared with peer stages (other pipelines, other nodes) ----------------------
    def export(self, tokens: Sequence[int], limit: int, after: int, *,
               namespace: str = "") -> PayloadManifest | None:
        """This stage's state for the longest prefix of `tokens` it holds, longer than
        `after` and at most `limit` tokens (a stride multiple), as a payload in the store
        that stays there for the asker to fetch; None when it holds nothing longer."""
        if not self.entries.enabled:
            return None
        self._expire_leases()
        scope, stride = self.scope(namespace), self.config.stride
        lengths = list(range(min(limit, len(tokens)) // stride * stride, after, -stride))
        if not lengths:
            return None
        digests = prefix_digests(scope, tokens, lengths)
        for b in lengths:
            if digests[b] in self._shared:
                return self._share(self._shared.pop(digests[b]))
        lane, own = self._best_warm_lane(tokens, lengths[0], namespace)
        hit = self.prefixes.lookup(scope, tokens, max_len=lengths[0])
        # peers share prefixes of stride multiples (a granular hit is cut to one, where
        # its state can be cut: never recurrent state)
        cut = 0 if hit is None else hit.length // stride * stride
        if hit is not None and cut != hit.length and self.entries.whole_entry:
            cut = 0
        try:
            if cut > max(own, after):
                manifest = self.entries.export(hit, cut, digests[cut])
            elif own > after:
                state = self.runtime.export_state(lane, own)
                manifest = encode_state(state, self.entries.kind_of(state), digests[own],
                                        self.key.stage_index, self.store, scope)
            else:
                return None
        except (BlockError, StageError, KeyError, ValueError, RuntimeError) as e:
            log.warning("stage %s: export failed: %s", self.key.stage_index, e)
            return None
        finally:
            self._release(hit)
        self.exports += 1
        return self._share(manifest)

    def _best_warm_lane(self, tokens, max_len: int, namespace: str) -> tuple[int, int]:
        """(a warm lane, its rows reusable for `tokens`: a stride multiple, or 0)."""
        stride, best = self.config.stride, (-1, 0)
        for lane in self.lanes.warm_lanes():
            n = self._own_reuse(lane, tokens, max_len, namespace)
            cut = n // stride * stride
            if cut != n and self.entries.whole_entry:
                cut = 0  # recurrent state exists only at the lane's end
            if cut > best[1]:
                best = (lane, cut)
        return best

    def adopt(self, tokens: Sequence[int], manifest: PayloadManifest, *,
              namespace: str = "") -> bool:
        """Take a payload pulled from a peer stage (its blocks already in the store, one
        reference each, which pass to this cache) as an entry for its prefix. False,
        with its references released, when it is not this stage's state for these
        tokens: another identity (model, split, CPU kind, tenant) never enters."""
        n = manifest.n_tokens
        scope = self.scope(namespace)
        if not self.entries.enabled or n > len(tokens) or \
                manifest.identity != prefix_digest(scope, tokens[:n]):
            release_payload(manifest, self.store)
            return False
        try:
            self.entries.adopt(tokens, decode_state(manifest, self.store), scope)
        except (BlockError, IncompatiblePayload, StageError, KeyError, ValueError,
                RuntimeError) as e:
            log.warning("stage %s: a pulled payload did not import: %s",
                        self.key.stage_index, e)
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

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Totals over this stage's caches (hits by kind, bytes by state), plus each part:
        `prefix` (resident KV or payload entries, under max_bytes), `results`, `blocks`;
        `restore_failures` (restores that failed after a plan: each one a recompute),
        `restores_declined` (hits left for recompute, where it was measured cheaper),
        `lanes_busy` and `lanes_warm` (request lanes held now, finished ones kept warm),
        `leases_held` and `leases_expired` (plans whose restore never came in time)."""
        prefix = self.prefixes.stats()
        extra = {name: c.stats() for name, c in (
            ("results", self.results), ("frames", self.frames),
            (COLD, self.cold.prefixes if self.cold is not None else None)) if c is not None}
        snap = merge([prefix, *extra.values()])
        snap["policy"] = self.policy
        snap["prefix"] = prefix.as_dict()
        for name, s in extra.items():
            snap[name] = s.as_dict()
        if self.store is not None:
            snap["blocks"] = {**dataclasses.asdict(self.store.stats()),
                              **self.store.node_stats()}
        if self.cold is not None:
            snap["cold_blocks"] = {**dataclasses.asdict(self.cold.store.stats()),
                                   **self.cold.store.node_stats()}
        snap["restore_failures"] = self.restore_failures
        snap["restores_declined"] = self.costs.declined
        snap["exports"], snap["adopted"] = self.exports, self.adopted
        snap["lanes_busy"], snap["lanes_warm"] = self.lanes.busy, self.lanes.warm
        snap["leases_held"] = len(self.leases)
        snap["leases_expired"] = self.leases.expired
        return snap

    def clear(self) -> None:
        """Forget every entry; one leased to a lane is freed when its lease ends."""
        self.entries.drop(self.prefixes.clear())
        if self.cold is not None:
            self.cold.drop(self.cold.prefixes.clear())
        for manifest in self._shared.values():
            release_payload(manifest, self.store)
        self._shared.clear()
        for c in (self.results, self.frames):
            if c is not None:
                c.clear()


def _rows(frame: Frame, a: int, b: int) -> Frame:
    """Positions [a, b) of a frame that covers them."""
    i, j = a - frame.start, b - frame.start
    if i < 0 or j > frame.n_rows:
        raise StageError(f"frame rows [{frame.start}, {frame.end}) do not cover [{a}, {b})")
    return Frame(a, frame.rows[i:j], None if frame.scale is None else frame.scale[i:j])


def _join(earlier: Frame | None, later: Frame, start: int) -> Frame | None:
    """Rows [0, later.end) from cached rows [0, start) and computed rows [start, ...);
    the computed rows alone when they start at 0, else None."""
    if later.start == 0:
        return later
    if earlier is None or earlier.end != start or later.start != start:
        return None
    if (earlier.scale is None) != (later.scale is None):
        return None
    scale = None if later.scale is None else torch.cat([earlier.scale, later.scale])
    return Frame(0, torch.cat([earlier.rows, later.rows]), scale)
