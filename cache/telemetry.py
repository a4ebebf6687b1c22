"""Cache counters, as an immutable snapshot the mesh exports (Prometheus, /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Counters:
    """Monotonic event counts of one cache object; mutated under its owner's lock."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0      # prefix tokens served by hits (work not recomputed)
    misses: int = 0
    probes: int = 0          # warm-up / health lookups: bypass every cache effect
    admissions: int = 0      # reservations granted
    not_admitted: int = 0    # seen too few times to capture yet
    bypasses: int = 0        # too large, too long, or only pinned entries to evict
    records: int = 0         # reservations committed
    refreshes: int = 0       # recording an identity that already exists
    evictions: int = 0
    collisions: int = 0      # hash matches that failed exact verification


@dataclass(frozen=True)
class CacheStats:
    kind: str
    entries: int
    resident_bytes: int
    reserved_bytes: int
    evictable_bytes: int
    pinned_entries: int
    counters: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def snapshot(c: Counters) -> dict:
    return {f.name: getattr(c, f.name) for f in fields(c)}


def merge(stats: list[CacheStats]) -> dict:
    """One snapshot of several caches (resident KV, activation frames, exact results):
    totals, hits by kind, and bytes by state, for the mesh to export."""
    out = {"hits_by_kind": {}, "resident_bytes": 0, "reserved_bytes": 0,
           "evictable_bytes": 0, "entries": 0}
    totals: dict[str, int] = {}
    for s in stats:
        out["hits_by_kind"][s.kind] = out["hits_by_kind"].get(s.kind, 0) + s.counters["hits"]
        for k in ("resident_bytes", "reserved_bytes", "evictable_bytes", "entries"):
            out[k] += getattr(s, k)
        for k, v in s.counters.items():
            totals[k] = totals.get(k, 0) + v
    out["counters"] = totals
    return out
