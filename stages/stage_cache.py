"""A stage's exact caches: the adapter between cache/ (pure decisions) and a runtime.

One `StageCache` per stage. It answers how much of a request's prefix this stage can
reuse, restores that state into the request's lane, runs the prefill, and records new
entries — by policy:

- ResidentKv (dense families): an entry is a runtime lane holding KV rows [0, L); it
  serves any chunk-aligned prefix it shares with a request (rows are copied into the
  request's lane). A lane that still holds the prefix itself (the hot lane) continues
  from its own state: no copy, no admission. On a runtime whose lanes are few
  (`lane_entries` False: llama.cpp) the entry is the exported state [0, L) as a payload
  in the block store instead, imported and cut to the hit's length.
- KvRecurrent (hybrid families): recurrent state cannot be rolled back, so state is
  captured as snapshots at admitted boundaries while the prefill passes them, exported as
  payloads into the block store, and imported whole on a hit.

- Activation frames (non-final stages): the rows [0, b) this stage sent downstream for
  an admitted prefix. When this stage can start at b but the next one must start
  earlier, rows [d, b) come from here instead of being recomputed.

The caller plans from the last stage back (`plan`: where each stage starts, given where
the next one starts), restores, then prefills from stage 0 on. Any failure to restore is reported, never raised: the caller recomputes. A
cache can make a request faster, never different and never failed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from skippy.cache.activation import ActivationCache
from skippy.cache.admission import Admission
from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.config import CacheConfig
from skippy.cache.identity import StageKey, page_id, prefix_digest
from skippy.cache.payload import (IncompatiblePayload, Manifest, PayloadKind, decode_payload,
                                  encode_payload, release_payload)
from skippy.cache.prefix_cache import PrefixCache
from skippy.cache.results import ExactResults
from skippy.cache.telemetry import merge

from .frame import Frame
from .runtime import LaneState, StageError, StageOutput, StageRuntime

log = logging.getLogger(__name__)

POLICIES = ("ResidentKv", "KvRecurrent", "disabled")
# Finished requests' lanes kept warm, on runtimes whose lanes are unlimited (each holds
# memory). A fixed-lane runtime (llama.cpp) keeps every idle lane warm until it is needed.
WARM_LANES = 4


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
    namespace: str = ""                              # whose tokens they are


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
        # dense entries as payloads rather than lanes (module docstring)
        self._stored = self.policy == "ResidentKv" and not runtime.lane_entries
        self.prefixes = PrefixCache(block=config.stride, max_entries=config.max_entries,
                                    max_bytes=config.max_bytes,
                                    max_tokens=config.max_tokens_per_entry, kind=self.policy,
                                    whole_entry=recurrent)
        self.admission = Admission(config.admit_after)
        self.store = store if store is not None else (
            BlockStore(config.block_store_max_bytes) if recurrent or self._stored else None)
        self.results = ExactResults(config.max_entries, config.activation_max_bytes) \
            if runtime.spec.is_last else None
        self.frames = ActivationCache(config.activation_max_entries,
                                      config.activation_max_bytes) \
            if not runtime.spec.is_last and config.activation_max_bytes else None
        self._width = runtime.cfg.hidden if self.frames is not None else 0  # frame row width
        self._scopes: dict[str, bytes] = {"": self.stage}
        self._entry_lanes: dict[int, int] = {}          # ResidentKv entry -> runtime lane
        self._entry_payloads: dict[int, Manifest] = {}  # KvRecurrent entry -> manifest
        self._lanes: dict[int, _LaneInfo] = {}
        self._warm: dict[int, None] = {}  # idle lanes that keep their rows, oldest first
        self._bytes_per_token: int | None = None

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self, tokens: Sequence[int] = (), namespace: str = "") -> int:
        """A lane for a request: the warm lane holding the longest reusable prefix of its
        tokens (a follow-up continues in place, nothing copied), else a fresh lane. A
        runtime out of lanes gives up its oldest warm lane. (Cache entries hold lanes
        only on runtimes whose lanes are unlimited, so they never keep one from a
        request.)"""
        best, most = None, 0
        for lane in self._warm:
            n = self._own_reuse(lane, tokens, len(tokens), namespace)
            if n > most:
                best, most = lane, n
        if best is not None:
            del self._warm[best]
            return best
        while True:
            try:
                lane = self.runtime.alloc_lane()
                break
            except StageError:
                if not self._warm:
                    raise
                self._free(next(iter(self._warm)))
        self._lanes[lane] = _LaneInfo()
        return lane

    def free_lane(self, lane: int, *, keep_warm: bool = False) -> None:
        """The request is over. `keep_warm`: the lane keeps its rows for a follow-up
        (never for a probe's rows, which bypass every cache)."""
        info = self._lanes.get(lane)
        if keep_warm and self.policy != "disabled" and info is not None and info.tokens:
            self._warm[lane] = None
            while self.runtime.lane_entries and len(self._warm) > WARM_LANES:
                self._free(next(iter(self._warm)))
            return
        self._free(lane)

    def drop_warm_lanes(self, keep: int = 0) -> None:
        """Free warm lanes, oldest first, down to `keep` (0: later hits must come from
        the cache entries)."""
        while len(self._warm) > keep:
            self._free(next(iter(self._warm)))

    def _free(self, lane: int) -> None:
        self._warm.pop(lane, None)
        self._lanes.pop(lane, None)
        self.runtime.free_lane(lane)

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
        from the frame cache; without them the stage starts no later than `downstream`."""
        best = self.available(lane, tokens, limit, probe=probe, namespace=namespace)
        if downstream is None or downstream >= best:
            return best
        if self._cached_frame(tokens, best, probe, namespace) is not None:
            return best
        return self.available(lane, tokens, downstream, probe=probe, namespace=namespace)

    def available(self, lane: int, tokens: Sequence[int], max_len: int, *,
                  probe: bool = False, namespace: str = "") -> int:
        """The longest chunk-aligned prefix (<= max_len) this stage could restore for
        `tokens` into `lane`: its own rows, or a cache entry. Pins nothing."""
        best = self._own_reuse(lane, tokens, max_len, namespace)
        if self.policy == "disabled" or probe or max_len < self.config.min_prefix:
            return best
        hit = self.prefixes.lookup(self.scope(namespace), tokens, max_len=max_len)
        if hit is None:
            return best
        self.prefixes.release(hit)
        return max(best, hit.length)

    def _own_reuse(self, lane: int, tokens: Sequence[int], max_len: int,
                   namespace: str = "") -> int:
        info = self._lanes[lane]
        if info.namespace != namespace:
            return 0
        held = info.tokens
        n = min(len(held), max_len)
        i = 0
        while i < n and held[i] == tokens[i]:
            i += 1
        reuse = self.runtime.resume_point(lane, i, len(tokens))
        if self.policy == "KvRecurrent" and reuse != self.runtime.lane_length(lane):
            return 0  # recurrent state exists only at the lane's very end
        return reuse

    def restore(self, lane: int, tokens: Sequence[int], start: int, *,
                namespace: str = "") -> bool:
        """Make `lane` hold this stage's state for tokens [0, start). False: it could not
        (evicted meanwhile, corrupt block): the caller recomputes from 0."""
        if start == 0 or self._own_reuse(lane, tokens, start, namespace) == start:
            return True  # nothing to restore, or the hot lane already holds it
        hit = self.prefixes.lookup(self.scope(namespace), tokens, max_len=start)
        if hit is None or hit.length != start:
            if hit is not None:
                self.prefixes.release(hit)
            return False
        try:
            if hit.entry_id in self._entry_lanes:
                self.runtime.copy_lane(self._entry_lanes[hit.entry_id], lane, start)
            else:
                state = self._load(self._entry_payloads[hit.entry_id])
                self.runtime.import_state(lane, state)
                if state.n_tokens > start:  # a dense entry serves its shorter prefixes
                    self.runtime.copy_lane(lane, lane, start)
            self._lanes[lane].tokens = list(tokens[:start])
            self._lanes[lane].namespace = namespace
            return True
        except (BlockError, IncompatiblePayload, KeyError, ValueError, RuntimeError) as e:
            # RuntimeError: the runtime refused the state (llama.cpp's LlamaCppError)
            log.warning("stage %s: dropping cache entry %s after a failed restore: %s",
                        self.key.stage_index, hit.entry_id, e)
            self.prefixes.remove(hit.entry_id)
            return False
        finally:
            self._drop(self.prefixes.release(hit))

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self, lane: int, tokens: Sequence[int], inputs, start: int,
                logits: str = "last", *, probe: bool = False, namespace: str = "",
                downstream: int | None = None,
                between_chunks: Callable[[], None] | None = None) -> StageOutput:
        """Prefill tokens [start, n) (inputs are ids for stage 0, a Frame otherwise) on a
        lane that holds [0, start), then record what was admitted. A non-final stage's
        frame covers rows [downstream, n) (default: [start, n)): rows before `start`
        come from the frame cache (the plan made sure they are there)."""
        n = len(tokens)
        scope = self.scope(namespace)
        boundaries = self._admitted(tokens, start, probe, scope)
        snapshots = tuple(boundaries) if self.policy == "KvRecurrent" else ()
        out = self.runtime.prefill(lane, inputs, start, logits, snapshots=snapshots,
                                   between_chunks=between_chunks)
        info = self._lanes[lane]
        info.tokens, info.namespace = list(tokens[:n]), namespace
        if self._stored and boundaries:
            b = max(boundaries)
            self._record_payload(tokens, b, self.runtime.export_state(lane, b), scope)
        elif self.policy == "ResidentKv" and boundaries:
            self._record_resident(lane, tokens, max(boundaries), scope)
        elif self.policy == "KvRecurrent":
            for b, state in sorted(out.snapshots.items(), reverse=True):
                self._record_payload(tokens, b, state, scope)
        if out.frame is not None:
            earlier = None
            if start and (boundaries or (downstream is not None and downstream < start)):
                earlier = self._cached_frame(tokens, start, probe, namespace)
            whole = _join(earlier, out.frame, start)  # rows [0, n) when the cache had [0, start)
            if boundaries and whole is not None:
                self._record_frames(tokens, boundaries, whole, scope)
            if downstream is not None and downstream != start:
                if downstream < start:
                    if whole is None:
                        raise StageError(f"no cached frame rows [{downstream}, {start})")
                    out.frame = _rows(whole, downstream, n)
                else:
                    out.frame = _rows(out.frame, downstream, n)
        return out

    def note_decoded(self, lane: int, token: int) -> None:
        """A decode step appended a row (never reused by a prefill, DESIGN.md §5.3)."""
        self._lanes[lane].tokens.append(int(token))

    def _admitted(self, tokens, start: int, probe: bool, scope: bytes) -> list[int]:
        """Boundaries past the restored start that have now been seen often enough."""
        if self.policy == "disabled" or probe:
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
        if self.frames is None or self.policy == "disabled" or probe or not start:
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

    def _record_resident(self, lane: int, tokens, b: int, scope: bytes) -> None:
        per_token = self._state_bytes_per_token(lane)
        r = self.prefixes.reserve(scope, tokens[:b], per_token * b)
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

    def _record_payload(self, tokens, b: int, state: LaneState, scope: bytes) -> None:
        token_arrays = {f"k.{i:04d}": t.numpy() for i, t in enumerate(state.keys)}
        token_arrays.update({f"v.{i:04d}": t.numpy() for i, t in enumerate(state.values)})
        fixed = {name: t.numpy() for name, t in state.fixed.items()}
        r = self.prefixes.reserve(scope, tokens[:b], state.nbytes)
        if r is None:
            return
        self._drop(list(r.evicted))
        # Recurrent state travels with its KV; a dense model's is ResidentKv (rows, or
        # the runtime's opaque KV bytes).
        kind = PayloadKind.KvRecurrent if fixed and self.policy == "KvRecurrent" else \
            PayloadKind.ResidentKv
        try:
            manifest = encode_payload(kind,
                                      prefix_digest(scope, tokens[:b]),
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
    def cached_result(self, tokens: Sequence[int], *, probe: bool = False,
                      namespace: str = ""):
        if self.results is None or self.policy == "disabled":
            return None
        return self.results.get_result(self.scope(namespace), tokens, probe=probe)

    def remember_result(self, tokens: Sequence[int], logits: torch.Tensor, *,
                        probe: bool = False, namespace: str = "") -> None:
        if self.results is None or self.policy == "disabled" or probe:
            return
        value = logits.clone()
        self.results.put_result(self.scope(namespace), tokens, value,
                                value.numel() * value.element_size())

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Totals over this stage's caches (hits by kind, bytes by state), plus each part:
        `prefix` (resident KV or payload entries, under max_bytes), `results`, `blocks`."""
        prefix = self.prefixes.stats()
        extra = {name: c.stats() for name, c in (("results", self.results),
                                                  ("frames", self.frames)) if c is not None}
        snap = merge([prefix, *extra.values()])
        snap["policy"] = self.policy
        snap["prefix"] = prefix.as_dict()
        for name, s in extra.items():
            snap[name] = s.as_dict()
        if self.store is not None:
            snap["blocks"] = dataclasses.asdict(self.store.stats())
        return snap

    def clear(self) -> None:
        self._drop(self.prefixes.clear())
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
