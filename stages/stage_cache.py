"""A stage's exact caches: the adapter between cache/ (pure decisions) and a runtime.

One `StageCache` per stage. It answers how much of a request's prefix this stage can
reuse, restores that state into the request's lane, runs the prefill, and records new
entries — by policy:

- ResidentKv (dense families): an entry is a runtime lane holding KV rows [0, L); it
  serves any chunk-aligned prefix it shares with a request (rows are copied into the
  request's lane). A lane that still holds the prefix itself (the hot lane) continues
  from its own state: no copy, no admission.
- KvRecurrent (hybrid families): recurrent state cannot be rolled back, so state is
  captured as snapshots at admitted boundaries while the prefill passes them, exported as
  payloads into the block store, and imported whole on a hit.

The caller (a pipeline) agrees on one reuse start across all stages, then restores and
prefills. Any failure to restore is reported, never raised: the caller recomputes. A
cache can make a request faster, never different and never failed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from skippy.cache.admission import Admission
from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.config import CacheConfig
from skippy.cache.identity import StageKey, prefix_digest
from skippy.cache.payload import (IncompatiblePayload, Manifest, PayloadKind, decode_payload,
                                  encode_payload, release_payload)
from skippy.cache.prefix_cache import PrefixCache
from skippy.cache.results import ExactResults
from skippy.cache.telemetry import merge

from .runtime import LaneState, StageError, StageOutput, StageRuntime

log = logging.getLogger(__name__)

POLICIES = ("ResidentKv", "KvRecurrent", "disabled")


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


@dataclass
class _LaneInfo:
    tokens: list[int] = field(default_factory=list)  # the tokens its prefill rows hold


class StageCache:
    def __init__(self, runtime: StageRuntime, config: CacheConfig, *, policy: str,
                 stage_key: StageKey | None = None, store: BlockStore | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}")
        if config.chunk != runtime.spec.chunk:
            raise ValueError(f"cache chunk {config.chunk} differs from the runtime's "
                             f"{runtime.spec.chunk}")
        self.runtime, self.config = runtime, config
        self.policy = policy if config.enabled else "disabled"
        self.key = stage_key or stage_key_for(runtime)
        self.stage = self.key.digest
        recurrent = self.policy == "KvRecurrent"
        self.prefixes = PrefixCache(block=config.stride, max_entries=config.max_entries,
                                    max_bytes=config.max_bytes,
                                    max_tokens=config.max_tokens_per_entry, kind=self.policy,
                                    whole_entry=recurrent)
        self.admission = Admission(config.admit_after)
        self.store = store if store is not None else (
            BlockStore(config.block_store_max_bytes) if recurrent else None)
        self.results = ExactResults(config.max_entries, config.activation_max_bytes) \
            if runtime.spec.is_last else None
        self._entry_lanes: dict[int, int] = {}          # ResidentKv entry -> runtime lane
        self._entry_payloads: dict[int, Manifest] = {}  # KvRecurrent entry -> manifest
        self._lanes: dict[int, _LaneInfo] = {}
        self._bytes_per_token: int | None = None

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self) -> int:
        lane = self.runtime.alloc_lane()
        self._lanes[lane] = _LaneInfo()
        return lane

    def free_lane(self, lane: int) -> None:
        self._lanes.pop(lane, None)
        self.runtime.free_lane(lane)

    # -- planning --------------------------------------------------------------------------
    def available(self, lane: int, tokens: Sequence[int], max_len: int, *,
                  probe: bool = False) -> int:
        """The longest chunk-aligned prefix (<= max_len) this stage could restore for
        `tokens` into `lane`: its own rows, or a cache entry. Pins nothing."""
        best = self._own_reuse(lane, tokens, max_len)
        if self.policy == "disabled" or probe or max_len < self.config.min_prefix:
            return best
        hit = self.prefixes.lookup(self.stage, tokens, max_len=max_len)
        if hit is None:
            return best
        self.prefixes.release(hit)
        return max(best, hit.length)

    def _own_reuse(self, lane: int, tokens: Sequence[int], max_len: int) -> int:
        held = self._lanes[lane].tokens
        n = min(len(held), max_len, self.runtime.prefill_boundary(lane))
        i = 0
        while i < n and held[i] == tokens[i]:
            i += 1
        reuse = i // self.runtime.spec.chunk * self.runtime.spec.chunk
        if self.policy == "KvRecurrent" and reuse != self.runtime.lane_length(lane):
            return 0  # recurrent state exists only at the lane's very end
        return reuse

    def restore(self, lane: int, tokens: Sequence[int], start: int) -> bool:
        """Make `lane` hold this stage's state for tokens [0, start). False: it could not
        (evicted meanwhile, corrupt block): the caller recomputes from 0."""
        if start == 0 or self._own_reuse(lane, tokens, start) == start:
            return True  # nothing to restore, or the hot lane already holds it
        hit = self.prefixes.lookup(self.stage, tokens, max_len=start)
        if hit is None or hit.length != start:
            if hit is not None:
                self.prefixes.release(hit)
            return False
        try:
            if self.policy == "ResidentKv":
                self.runtime.copy_lane(self._entry_lanes[hit.entry_id], lane, start)
            else:
                state = self._load(self._entry_payloads[hit.entry_id])
                self.runtime.import_state(lane, state)
            self._lanes[lane].tokens = list(tokens[:start])
            return True
        except (BlockError, IncompatiblePayload, KeyError, ValueError) as e:
            log.warning("stage %s: dropping cache entry %s after a failed restore: %s",
                        self.key.stage_index, hit.entry_id, e)
            self.prefixes.remove(hit.entry_id)
            return False
        finally:
            self._drop(self.prefixes.release(hit))

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, lane: int, tokens: Sequence[int], inputs, start: int,
                logits: str = "last", *, probe: bool = False) -> StageOutput:
        """Prefill tokens [start, n) (inputs are ids for stage 0, a Frame otherwise) on a
        lane that holds [0, start), then record what was admitted."""
        n = len(tokens)
        boundaries = self._admitted(tokens, start, probe)
        snapshots = tuple(boundaries) if self.policy == "KvRecurrent" else ()
        out = self.runtime.prefill(lane, inputs, start, logits, snapshots=snapshots)
        self._lanes[lane].tokens = list(tokens[:n])
        if self.policy == "ResidentKv" and boundaries:
            self._record_resident(lane, tokens, max(boundaries))
        elif self.policy == "KvRecurrent":
            for b, state in sorted(out.snapshots.items(), reverse=True):
                self._record_payload(tokens, b, state)
        return out

    def note_decoded(self, lane: int, token: int) -> None:
        """A decode step appended a row (never reused by a prefill, DESIGN.md §5.3)."""
        self._lanes[lane].tokens.append(int(token))

    def _admitted(self, tokens, start: int, probe: bool) -> list[int]:
        """Boundaries past the restored start that have now been seen often enough."""
        if self.policy == "disabled" or probe:
            return []
        limit = len(tokens) // self.runtime.spec.chunk * self.runtime.spec.chunk
        candidates = [b for b in self.config.record_lengths(len(tokens)) if start < b <= limit]
        return [b for b in candidates
                if self.admission.observe(prefix_digest(self.stage, tokens[:b]))]

    def _record_resident(self, lane: int, tokens, b: int) -> None:
        per_token = self._state_bytes_per_token(lane)
        r = self.prefixes.reserve(self.stage, tokens[:b], per_token * b)
        if r is None:
            return
        self._drop(list(r.evicted))
        try:
            holder = self.runtime.alloc_lane()
        except StageError:  # no lane free to hold the entry: skip recording, never fail
            self.prefixes.abort(r)
            return
        try:
            self.runtime.copy_lane(lane, holder, b)
        except Exception:
            self.runtime.free_lane(holder)
            self.prefixes.abort(r)
            raise
        if self.prefixes.commit(r):
            self._entry_lanes[r.entry_id] = holder
        else:
            self.runtime.free_lane(holder)

    def _record_payload(self, tokens, b: int, state: LaneState) -> None:
        token_arrays = {f"k.{i:04d}": t.numpy() for i, t in enumerate(state.keys)}
        token_arrays.update({f"v.{i:04d}": t.numpy() for i, t in enumerate(state.values)})
        fixed = {name: t.numpy() for name, t in state.fixed.items()}
        r = self.prefixes.reserve(self.stage, tokens[:b], state.nbytes)
        if r is None:
            return
        self._drop(list(r.evicted))
        # Recurrent state travels with its KV; a dense model's exported KV is ResidentKv.
        kind = PayloadKind.KvRecurrent if fixed else PayloadKind.ResidentKv
        try:
            manifest = encode_payload(kind,
                                      prefix_digest(self.stage, tokens[:b]),
                                      {"stage_index": self.key.stage_index, "prefilled":
                                       state.prefilled}, token_arrays, fixed, b, self.store)
        except BlockError:
            self.prefixes.abort(r)
            return
        if self.prefixes.commit(r):
            self._entry_payloads[r.entry_id] = manifest
        else:
            release_payload(manifest, self.store)

    def _load(self, manifest: Manifest) -> LaneState:
        token_arrays, fixed = decode_payload(manifest, self.store)
        keys = [torch.from_numpy(np.array(token_arrays[k])) for k in sorted(token_arrays)
                if k.startswith("k.")]
        values = [torch.from_numpy(np.array(token_arrays[k])) for k in sorted(token_arrays)
                  if k.startswith("v.")]
        return LaneState(manifest.n_tokens, int(manifest.identity_fields["prefilled"]),
                         keys, values, {k: torch.from_numpy(np.array(v)) for k, v in fixed.items()})

    def _state_bytes_per_token(self, lane: int) -> int:
        if self._bytes_per_token is None:
            self._bytes_per_token = self.runtime.export_state(lane, 1).nbytes
        return self._bytes_per_token

    def _drop(self, entry_ids: list[int]) -> None:
        """Free the state of entries the cache evicted or removed."""
        for eid in entry_ids:
            holder = self._entry_lanes.pop(eid, None)
            if holder is not None:
                self.runtime.free_lane(holder)
            manifest = self._entry_payloads.pop(eid, None)
            if manifest is not None:
                release_payload(manifest, self.store)

    # -- exact results (last stage) ----------------------------------------------------------
    def cached_result(self, tokens: Sequence[int], *, probe: bool = False):
        if self.results is None or self.policy == "disabled":
            return None
        return self.results.get_result(self.stage, tokens, probe=probe)

    def remember_result(self, tokens: Sequence[int], logits: torch.Tensor, *,
                        probe: bool = False) -> None:
        if self.results is None or self.policy == "disabled" or probe:
            return
        value = logits.clone()
        self.results.put_result(self.stage, tokens, value, value.numel() * value.element_size())

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Totals over this stage's caches (hits by kind, bytes by state), plus each part:
        `prefix` (resident KV or payload entries, under max_bytes), `results`, `blocks`."""
        prefix = self.prefixes.stats()
        parts = [prefix] + ([self.results.stats()] if self.results is not None else [])
        snap = merge(parts)
        snap["policy"] = self.policy
        snap["prefix"] = prefix.as_dict()
        if self.results is not None:
            snap["results"] = parts[1].as_dict()
        if self.store is not None:
            snap["blocks"] = dataclasses.asdict(self.store.stats())
        return snap

    def clear(self) -> None:
        self._drop(self.prefixes.clear())
        if self.results is not None:
            self.results.clear()
