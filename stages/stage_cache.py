"""A stage's exact caches: the adapter between cache/ (pure decisions) and a runtime.

One `StageCache` per stage, composed of a part per concern, each chosen once:
- the request lanes, and finished ones kept warm for a follow-up (`lanes.py`); a lane
  that still holds the prefix itself continues from its own state: no copy, no admission;
- the entries by tier, RAM's (how they are held is the family's policy,
  `cache_policy.py`) and the disk tier's, with the leases that pin a plan's hit until its
  restore (`cache_tiers.py`);
- a non-final stage's activation frames (`frame_cache.py`);
- the last stage's exact results (`cache/results.py`);
- the state shared with peer stages (`peer_share.py`).
This class plans (how much of a request's prefix this stage can reuse), restores that
state into the request's lane, runs the prefill and records what admission lets in.

The caller plans from the last stage back (`plan`: where each stage starts, given where
the next one starts), restores, then prefills from stage 0 on. A request's calls share
one `CacheScope` (`scope`: its tenant namespace, and whether it is a probe), chosen once.
Any failure to restore is reported, never raised: the caller recomputes. A cache can make
a request faster, never different and never failed.

Not thread-safe: a stage makes its runtime and cache calls one at a time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from skippy.cache.admission import PrefixAdmission
from skippy.cache.blocks import BlockStore
from skippy.cache.config import CacheConfig
from skippy.cache.identity import StageKey, prefix_digest
from skippy.cache.results import ExactResults
from skippy.cache.telemetry import merge

from .cache_policy import CachePolicy, policy_class
from .cache_scope import CacheScope
from .cache_tiers import COLD, CacheTiers
from .frame_cache import StageFrames
from .lanes import Lanes
from .leases import Leases
from .peer_share import PeerShare
from .runtime import StageOutput, StageRuntime
from .stage_spec import Exactness

# Finished requests' lanes kept warm, on runtimes whose lanes are unlimited (each holds
# memory). A fixed-lane runtime (llama.cpp) keeps every idle lane warm until it is needed.
WARM_LANES = 4
# A plan's lease on its hit ends this long after the plan if no restore consumed it.
LEASE_SECONDS = 30.0


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
                 store: BlockStore | None = None, cold_store: BlockStore | None = None,
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
        self.key = stage_key_for(runtime, runtime.spec.topology_digest)
        # Row-invariant stages reuse to the token (DESIGN.md §5.3): entries hold whole
        # prompts and turns, and a KV hit may end at any token (recurrent state: at an
        # entry's end, wherever that is).
        self.granular = runtime.exactness is Exactness.ROW_INVARIANT
        # Every policy's state can travel between nodes as payloads, so every stage has a
        # store: entries live there for payload policies, shared payloads for all.
        self.store = store if store is not None else BlockStore(config.block_store_max_bytes)
        self.tiers = CacheTiers(runtime, config, cls, self.store, cold_store,
                                self.key.stage_index, self.granular,
                                Leases(lease_seconds, clock))
        self.admission = PrefixAdmission(config.admit_after)
        self.lanes = Lanes(runtime, WARM_LANES if runtime.lane_entries else None,
                           keep=self._keep_lane if self.granular else None)
        last = runtime.spec.is_last
        self.results = ExactResults(config.max_entries, config.activation_max_bytes) \
            if last and self.entries.enabled else None
        self.frames = None if last else StageFrames(config, runtime.cfg.hidden,
                                                    keep=self.entries.enabled)
        self.peers = PeerShare(runtime, self.tiers, self.lanes, self.store, config.stride,
                               self._own_reuse)
        self._scopes: dict[tuple[str, bool], CacheScope] = {}

    @property
    def entries(self) -> CachePolicy:
        """RAM's entries (the family's policy)."""
        return self.tiers.entries

    def scope(self, namespace: str = "", probe: bool = False) -> CacheScope:
        """A request's scope: the stage digest its entries are keyed under (one per tenant
        namespace) and whether it is a probe. Memoised; the same value from any thread."""
        s = self._scopes.get((namespace, probe))
        if s is None:
            key = dataclasses.replace(self.key, namespace=namespace).digest
            s = self._scopes[(namespace, probe)] = CacheScope(namespace, key, probe)
        return s

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self, tokens: Sequence[int] = (), scope: CacheScope | None = None) -> int:
        """A lane for a request: the warm lane holding the longest reusable prefix of its
        tokens (a follow-up continues in place, nothing copied), else a fresh lane. A
        runtime out of lanes gives up its oldest warm lane. (Cache entries hold lanes
        only on runtimes whose lanes are unlimited, so they never keep one from a
        request.)"""
        scope = scope or self.scope()
        self.tiers.expire_leases()
        return self.lanes.alloc(lambda lane: self._own_reuse(lane, tokens, len(tokens), scope))

    def free_lane(self, lane: int, *, keep_warm: bool = False) -> None:
        """The request is over; its lease, if any, ends. `keep_warm`: the lane keeps its
        rows for a follow-up (never for a probe's rows, which bypass every cache)."""
        self.tiers.end_lease(lane)
        self.lanes.release(lane, keep_warm=keep_warm and self.entries.enabled)

    def _keep_lane(self, lane: int, info) -> bool:
        """A warm lane pushed out: its rows, a reply's included, become a cache entry
        (the lane itself, no copy) so that the conversation's next turn still finds
        them. False: the entries did not take it."""
        n = min(len(info.tokens), self.runtime.lane_length(lane))
        return self.entries.keep_lane(lane, info.tokens[:n], self.scope(info.namespace).key)

    def drop_warm_lanes(self, keep: int = 0) -> None:
        """Free warm lanes, oldest first, down to `keep` (0: later hits must come from
        the cache entries)."""
        self.lanes.drop_warm(keep)

    def note_decoded(self, lane: int, tokens: Sequence[int]) -> None:
        """A decode step appended rows (a verify step's proposed tokens too): reused by a
        later prefill where the runtime keeps the row-invariant contract, never on a
        chunked one (DESIGN.md §5.3)."""
        self.lanes.info(lane).tokens.extend(int(t) for t in tokens)

    def rewind(self, lane: int, n_tokens: int) -> None:
        """The lane back to its first n_tokens (a verify step's rejected rows dropped)."""
        self.runtime.rewind(lane, n_tokens)
        del self.lanes.info(lane).tokens[n_tokens:]

    def _own_reuse(self, lane: int, tokens: Sequence[int], max_len: int,
                   scope: CacheScope) -> int:
        info = self.lanes.info(lane)
        if info.namespace != scope.namespace:
            return 0
        held = info.tokens
        n = min(len(held), max_len)
        i = 0
        while i < n and held[i] == tokens[i]:
            i += 1
        return self.entries.own_reuse(lane, self.runtime.resume_point(lane, i, len(tokens)))

    # -- planning and restore --------------------------------------------------------------
    def plan(self, lane: int, tokens: Sequence[int], limit: int, downstream: int | None,
             scope: CacheScope | None = None) -> int:
        """Where this stage starts its prefill, given that the next stage needs rows from
        `downstream` (None at the last stage). Rows [downstream, start) are then served
        from the frame cache; without them the stage starts no later than `downstream`.
        When the start comes from a cache entry, the entry is leased to the lane (pinned)
        until `restore` consumes it, or a new plan, a prefill, `free_lane` or expiry
        ends the lease."""
        scope = scope or self.scope()
        self.tiers.end_lease(lane)
        best, hit = self._best(lane, tokens, limit, scope)
        if downstream is not None and downstream < best and \
                self.frames.cached(tokens, best, scope) is None:
            self.tiers.release(hit)
            best, hit = self._best(lane, tokens, downstream, scope)
        if hit is not None:
            self.tiers.lease(lane, hit, scope, tokens)
        return best

    def available(self, lane: int, tokens: Sequence[int], max_len: int,
                  scope: CacheScope | None = None) -> int:
        """The longest prefix (<= max_len) this stage could restore for `tokens` into
        `lane`: its own rows, or a cache entry. Pins nothing."""
        best, hit = self._best(lane, tokens, max_len, scope or self.scope())
        self.tiers.release(hit)
        return best

    def _best(self, lane: int, tokens: Sequence[int], max_len: int, scope: CacheScope):
        return self.tiers.best(tokens, max_len, self._own_reuse(lane, tokens, max_len, scope),
                               scope)

    def restore(self, lane: int, tokens: Sequence[int], start: int,
                scope: CacheScope | None = None) -> bool:
        """Make `lane` hold this stage's state for tokens [0, start), from the entry its
        plan leased (else a fresh lookup). False: it could not (a corrupt block, an
        unplanned start whose entry went away): the caller recomputes from 0."""
        scope = scope or self.scope()
        lease = self.tiers.take_lease(lane)
        if start == 0 or self._own_reuse(lane, tokens, start, scope) == start:
            self.tiers.release_lease(lease)
            return True  # nothing to restore, or the hot lane already holds it
        if not self.tiers.restore(lane, tokens, start, scope, lease):
            return False
        self.lanes.hold(lane, tokens[:start], scope.namespace)
        return True

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, lane: int, tokens: Sequence[int], inputs, start: int,
                logits: str = "last", scope: CacheScope | None = None, *,
                downstream: int | None = None,
                between_chunks: Callable[[], None] | None = None) -> StageOutput:
        """Prefill tokens [start, n) (inputs are ids for stage 0, a Frame otherwise) on a
        lane that holds [0, start), then record what was admitted. A non-final stage's
        frame covers rows [downstream, n) (default: [start, n)): rows before `start`
        come from the frame cache (the plan made sure they are there). A lease the lane
        still holds ends here: its restore was skipped."""
        scope = scope or self.scope()
        self.tiers.end_lease(lane)
        boundaries = self._admitted(tokens, start, scope)
        t = time.perf_counter()
        out = self.runtime.prefill(lane, inputs, start, logits,
                                   snapshots=self.entries.snapshots(boundaries),
                                   between_chunks=between_chunks)
        self.tiers.costs.prefilled(len(tokens) - start, time.perf_counter() - t)
        self.lanes.hold(lane, tokens, scope.namespace)
        self.entries.record(lane, tokens, boundaries, out, scope.key)
        if out.frame is not None:
            out.frame = self.frames.after_prefill(tokens, start, out.frame, boundaries,
                                                  scope, downstream)
        return out

    def _admitted(self, tokens, start: int, scope: CacheScope) -> list[int]:
        """Boundaries past the restored start that have now been seen often enough."""
        if not self.entries.enabled or scope.probe:
            return []
        limit = len(tokens) // self.runtime.spec.chunk * self.runtime.spec.chunk
        candidates = [b for b in self.config.record_lengths(len(tokens)) if start < b <= limit]
        return [b for b in candidates
                if self.admission.observe(prefix_digest(scope.key, tokens[:b]))]

    # -- exact results (last stage) ----------------------------------------------------------
    def cached_result(self, tokens: Sequence[int], scope: CacheScope | None = None):
        scope = scope or self.scope()
        if self.results is None:
            return None
        return self.results.get_result(scope.key, tokens, probe=scope.probe)

    def remember_result(self, tokens: Sequence[int], logits: torch.Tensor,
                        scope: CacheScope | None = None) -> None:
        scope = scope or self.scope()
        if self.results is None or scope.probe:
            return
        value = logits.clone()
        self.results.put_result(scope.key, tokens, value, value.numel() * value.element_size())

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Totals over this stage's caches (hits by kind, bytes by state), plus each part:
        `prefix` (resident KV or payload entries, under max_bytes), `results`, `blocks`;
        `restore_failures` (restores that failed after a plan: each one a recompute),
        `restores_declined` (hits left for recompute, where it was measured cheaper),
        `lanes_busy` and `lanes_warm` (request lanes held now, finished ones kept warm),
        `leases_held` and `leases_expired` (plans whose restore never came in time)."""
        tiers = self.tiers
        prefix = tiers.prefixes.stats()
        frames = None if self.frames is None else self.frames.store
        extra = {name: c.stats() for name, c in (
            ("results", self.results), ("frames", frames),
            (COLD, tiers.cold.prefixes if tiers.cold is not None else None)) if c is not None}
        snap = merge([prefix, *extra.values()])
        snap["policy"] = self.policy
        snap["prefix"] = prefix.as_dict()
        for name, s in extra.items():
            snap[name] = s.as_dict()
        snap["blocks"] = {**dataclasses.asdict(self.store.stats()), **self.store.node_stats()}
        if tiers.cold is not None:
            snap["cold_blocks"] = {**dataclasses.asdict(tiers.cold.store.stats()),
                                   **tiers.cold.store.node_stats()}
        snap["restore_failures"] = tiers.failures
        snap["restores_declined"] = tiers.costs.declined
        snap["exports"], snap["adopted"] = self.peers.exports, self.peers.adopted
        snap["lanes_busy"], snap["lanes_warm"] = self.lanes.busy, self.lanes.warm
        snap["leases_held"] = len(tiers.leases)
        snap["leases_expired"] = tiers.leases.expired
        return snap

    def clear(self) -> None:
        """Forget every entry; one leased to a lane is freed when its lease ends."""
        self.tiers.clear()
        self.peers.clear()
        for c in (self.results, self.frames):
            if c is not None:
                c.clear()
