"""What one request's cache calls share, chosen once when its session begins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheScope:
    """A request's tenant `namespace`, the stage digest its entries are keyed under for
    that namespace (`key`: one tenant never hits, nor times, another's prefixes), and
    whether it is a `probe` (whose rows bypass every cache: no lookups, no records)."""
    namespace: str
    key: bytes
    probe: bool = False
