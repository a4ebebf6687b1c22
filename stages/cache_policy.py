"""How a stage's prefix-cache entries are held, recorded, restored and dropped: one
policy object per StageCache, chosen once (`policy_class`) from the family's policy
name and the runtime.

- ResidentLanes (ResidentKv, dense families): an entry is a runtime lane holding KV rows
  [0, L); it serves any chunk-aligned prefix it shares with a request (rows are copied
  into the request's lane).
- StoredPayloads (ResidentKv on a runtime whose lanes are few, `lane_entries` False:
  llama.cpp): the entry is the exported state [0, L) as a payload in the block store,
  imported and cut to the hit's length, so entries never take a request's lane.
- RecurrentSnapshots (KvRecurrent, hybrid families): recurrent state cannot be rolled
  back, so it is captured as snapshots at admitted boundaries while the prefill passes
  them, stored as payloads, and imported whole on a hit; a lane continues from its own
  state only at its very end.
- Disabled: no entries; a lane still continues from its own rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.identity import prefix_digest
from skippy.cache.payload import (PayloadManifest, PayloadKind, decode_payload, encode_payload,
                                  release_payload)
from skippy.cache.prefix_cache import Hit, PrefixCache

from .runtime import LaneState, StageError, StageOutput, StageRuntime

log = logging.getLogger(__name__)

POLICIES = ("ResidentKv", "KvRecurrent", "disabled")


class CachePolicy:
    """The operations that differ between policies; StageCache does the rest."""

    name = "disabled"        # the payload kind its hits count under
    enabled = True           # False: no lookups, records, warm lanes or results
    whole_entry = False      # an entry serves only queries holding all its tokens
    stores_payloads = False  # entries live in a block store

    def __init__(self, runtime: StageRuntime, prefixes: PrefixCache,
                 store: BlockStore | None, stage_index: int):
        self.runtime, self.prefixes, self.store = runtime, prefixes, store
        self.stage_index = stage_index
        self.keys: dict[int, tuple[bytes, tuple]] = {}  # entry id -> (scope, its tokens)
        # Where an entry the caps push out goes (scope, tokens, state), if anywhere: a
        # colder tier keeps it instead of dropping it (StageCache's disk tier).
        self.demote: Callable[[bytes, tuple, LaneState], None] | None = None

    def own_reuse(self, lane: int, reuse: int) -> int:
        """How much of the `reuse` rows a lane shares with a request it may keep."""
        return reuse

    def snapshots(self, boundaries: list[int]) -> tuple[int, ...]:
        """Boundaries at which the prefill must hand back exported state."""
        return ()

    def record(self, lane: int, tokens, boundaries: list[int], out: StageOutput,
               scope: bytes) -> None:
        """Record entries for the admitted boundaries after a successful prefill."""

    def keep_lane(self, lane: int, tokens, scope: bytes) -> bool:
        """Take a finished lane whose rows hold `tokens` as an entry; False: not taken."""
        return False

    def restore(self, lane: int, hit: Hit, start: int) -> None:
        """Make `lane` hold the hit's state for [0, start); raises when it cannot."""
        raise KeyError(f"no state for entry {hit.entry_id}")

    def drop(self, entry_ids) -> None:
        """Free the state of entries the prefix cache evicted or removed."""

    def kind_of(self, state: LaneState) -> PayloadKind:
        """The payload kind this policy stores `state` as."""
        return PayloadKind.ResidentKv

    def export(self, hit: Hit, length: int, identity: bytes) -> PayloadManifest:
        """The hit's state for [0, length) as a payload in the store, for a peer stage
        to import; the caller owns one reference on each of its blocks."""
        raise KeyError(f"no state for entry {hit.entry_id}")

    def adopt(self, tokens, state: LaneState, scope: bytes) -> None:
        """Record state a peer stage computed for tokens [0, state.n_tokens) as an entry."""

    def _state_of(self, entry_id: int, n_tokens: int) -> LaneState:
        """An entry's state, for its demotion."""
        raise KeyError(f"no state for entry {entry_id}")

    def _evicted(self, entry_ids) -> None:
        """Entries the caps pushed out: demoted to the colder tier where there is one."""
        for eid in entry_ids:
            key = self.keys.get(eid)
            if self.demote is not None and key is not None:
                try:
                    self.demote(key[0], key[1], self._state_of(eid, len(key[1])))
                except Exception as e:  # a tier that cannot take it: dropped as before
                    log.warning("stage %d: an evicted entry was not demoted: %s",
                                self.stage_index, e)
        self.drop(entry_ids)


class Disabled(CachePolicy):
    enabled = False


class ResidentLanes(CachePolicy):
    name = "ResidentKv"

    def __init__(self, *args):
        super().__init__(*args)
        self.holders: dict[int, int] = {}   # entry id -> runtime lane holding its rows
        self._bytes_per_token: int | None = None

    def record(self, lane, tokens, boundaries, out, scope) -> None:
        if not boundaries:
            return
        # shorter prefixes are served from the same rows; a granular entry holds the
        # whole prompt, so that a hit may run to any token of it
        whole = self.prefixes.granular and len(tokens) <= (self.prefixes.max_tokens or len(tokens))
        b = len(tokens) if whole else max(boundaries)
        self._hold(scope, tokens[:b], self._per_token(lane) * b,
                   lambda holder: self.runtime.copy_lane(lane, holder, b))

    def keep_lane(self, lane, tokens, scope) -> bool:
        if not self.prefixes.granular:
            return False
        r = self.prefixes.reserve(scope, tokens, self._per_token(lane) * len(tokens))
        if r is None:
            return False
        self._evicted(r.evicted)
        if not self.prefixes.commit(r):
            return False
        self.holders[r.entry_id] = lane
        self.keys[r.entry_id] = (scope, tuple(tokens))
        return True

    def restore(self, lane, hit, start) -> None:
        self.runtime.copy_lane(self.holders[hit.entry_id], lane, start)

    def export(self, hit, length, identity) -> PayloadManifest:
        state = self.runtime.export_state(self.holders[hit.entry_id], length)
        return encode_state(state, self.kind_of(state), identity, self.stage_index, self.store,
                            self.keys[hit.entry_id][0])

    def adopt(self, tokens, state, scope) -> None:
        self._hold(scope, tokens[:state.n_tokens], state.nbytes,
                   lambda holder: self.runtime.import_state(holder, state))

    def _hold(self, scope: bytes, tokens, nbytes: int, fill) -> None:
        """An entry for `tokens`: a lane of its own, filled by `fill(lane)`."""
        r = self.prefixes.reserve(scope, tokens, nbytes)
        if r is None:
            return
        self._evicted(r.evicted)
        try:
            holder = self.runtime.alloc_lane()
        except StageError:  # no lane free to hold the entry: skip recording, never fail
            self.prefixes.abort(r)
            return
        try:
            fill(holder)
        except Exception:
            self.runtime.free_lane(holder)
            self.prefixes.abort(r)
            raise
        if self.prefixes.commit(r):
            self.holders[r.entry_id] = holder
            self.keys[r.entry_id] = (scope, tuple(tokens))
        else:
            self.runtime.free_lane(holder)

    def _state_of(self, entry_id, n_tokens) -> LaneState:
        return self.runtime.export_state(self.holders[entry_id], n_tokens)

    def drop(self, entry_ids) -> None:
        for eid in entry_ids:
            self.keys.pop(eid, None)
            holder = self.holders.pop(eid, None)
            if holder is not None:
                self.runtime.free_lane(holder)

    def _per_token(self, lane: int) -> int:
        if self._bytes_per_token is None:
            self._bytes_per_token = self.runtime.export_state(lane, 1).nbytes
        return self._bytes_per_token


class _Payloads(CachePolicy):
    """Entries as exported state in the block store."""

    stores_payloads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.manifests: dict[int, PayloadManifest] = {}

    def restore(self, lane, hit, start) -> None:
        state = decode_state(self.manifests[hit.entry_id], self.store)
        self.runtime.import_state(lane, state)
        if state.n_tokens > start:  # a dense entry serves its shorter prefixes
            self.runtime.copy_lane(lane, lane, start)

    def drop(self, entry_ids) -> None:
        for eid in entry_ids:
            self.keys.pop(eid, None)
            manifest = self.manifests.pop(eid, None)
            if manifest is not None:
                release_payload(manifest, self.store)

    def _record(self, tokens, b: int, state: LaneState, scope: bytes) -> None:
        r = self.prefixes.reserve(scope, tokens[:b], state.nbytes)
        if r is None:
            return
        self._evicted(r.evicted)
        try:
            manifest = encode_state(state, self.kind_of(state), prefix_digest(scope, tokens[:b]),
                                    self.stage_index, self.store, scope)
        except BlockError:
            self.prefixes.abort(r)
            return
        if self.prefixes.commit(r):
            self.manifests[r.entry_id] = manifest
            self.keys[r.entry_id] = (scope, tuple(tokens[:b]))
        else:
            release_payload(manifest, self.store)

    def _state_of(self, entry_id, n_tokens) -> LaneState:
        return decode_state(self.manifests[entry_id], self.store)

    def export(self, hit, length, identity) -> PayloadManifest:
        manifest = self.manifests[hit.entry_id]
        if manifest.n_tokens == length:  # as stored: the caller's references, no copy
            for h in manifest.blocks:
                self.store.retain(h)
            return manifest
        state = cut_state(decode_state(manifest, self.store), length)
        return encode_state(state, self.kind_of(state), identity, self.stage_index, self.store,
                            manifest.scope)

    def adopt(self, tokens, state, scope) -> None:
        self._record(tokens, state.n_tokens, state, scope)


class StoredPayloads(_Payloads):
    name = "ResidentKv"

    def record(self, lane, tokens, boundaries, out, scope) -> None:
        if boundaries:
            b = max(boundaries)  # shorter prefixes are cut from the imported state
            self._record(tokens, b, self.runtime.export_state(lane, b), scope)


class RecurrentSnapshots(_Payloads):
    name = "KvRecurrent"
    whole_entry = True

    def own_reuse(self, lane, reuse) -> int:
        # recurrent state exists only at the lane's very end, or on a row-invariant stage
        # also where its runtime's resume point says the lane kept it
        if self.prefixes.granular:
            return reuse
        return reuse if reuse == self.runtime.lane_length(lane) else 0

    def snapshots(self, boundaries) -> tuple[int, ...]:
        return tuple(boundaries)

    def record(self, lane, tokens, boundaries, out, scope) -> None:
        for b, state in sorted(out.snapshots.items(), reverse=True):
            self._record(tokens, b, state, scope)
        n = len(tokens)
        if boundaries and self.prefixes.granular and n not in out.snapshots:
            # the end of the prompt, where its next turn goes on
            self._record(tokens, n, self.runtime.export_state(lane, n), scope)

    def keep_lane(self, lane, tokens, scope) -> bool:
        # the lane's end, its reply included, as a payload; the lane itself is freed
        n = len(tokens)
        if self.prefixes.granular and n == self.runtime.lane_length(lane):
            self._record(tokens, n, self.runtime.export_state(lane, n), scope)
        return False

    def kind_of(self, state: LaneState) -> PayloadKind:
        # Recurrent state travels with its KV; a dense model's snapshots are KV alone.
        return PayloadKind.KvRecurrent if state.fixed else PayloadKind.ResidentKv


def policy_class(name: str, runtime: StageRuntime, enabled: bool = True) -> type[CachePolicy]:
    """The one choice of policy: by name, and for ResidentKv by whether the runtime's
    lanes are plentiful enough to hold entries."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}")
    if not enabled or name == "disabled":
        return Disabled
    if name == "KvRecurrent":
        return RecurrentSnapshots
    return ResidentLanes if runtime.lane_entries else StoredPayloads


# -- state as payloads: what an entry stores, and what travels between nodes ----------------
def encode_state(state: LaneState, kind: PayloadKind, identity: bytes, stage_index: int,
                 store: BlockStore, scope: bytes) -> PayloadManifest:
    """The state as a payload in `store` (its blocks hold one reference each), its blocks
    those of `scope` (the stage and namespace) alone."""
    token_arrays = {f"k.{i:04d}": t.numpy() for i, t in enumerate(state.keys)}
    token_arrays.update({f"v.{i:04d}": t.numpy() for i, t in enumerate(state.values)})
    fixed = {name: t.numpy() for name, t in state.fixed.items()}
    return encode_payload(kind, identity, {"stage_index": stage_index,
                                           "prefilled": state.prefilled},
                          token_arrays, fixed, state.n_tokens, store, scope)


def decode_state(manifest: PayloadManifest, store: BlockStore) -> LaneState:
    """The state a payload holds, every block verified by the store."""
    token_arrays, fixed = decode_payload(manifest, store)
    keys = [torch.from_numpy(np.array(token_arrays[k])) for k in sorted(token_arrays)
            if k.startswith("k.")]
    values = [torch.from_numpy(np.array(token_arrays[k])) for k in sorted(token_arrays)
              if k.startswith("v.")]
    return LaneState(manifest.n_tokens, int(manifest.identity_fields["prefilled"]),
                     keys, values, {k: torch.from_numpy(np.array(v)) for k, v in fixed.items()})


def cut_state(state: LaneState, length: int) -> LaneState:
    """Rows [0, length) of a dense state (recurrent state exists only at its end)."""
    if length == state.n_tokens:
        return state
    if state.fixed or length > state.n_tokens:
        raise ValueError(f"a state of {state.n_tokens} tokens cannot serve {length}")
    return LaneState(length, min(state.prefilled, length), [k[:length] for k in state.keys],
                     [v[:length] for v in state.values])
