"""Leases: one per lane, serving only the restore that was planned, expiring lazily."""

from __future__ import annotations

import pytest

from skippy.cache.prefix_cache import Hit
from skippy.stages.leases import Leases


def test_a_lease_serves_only_the_planned_restore():
    leases = Leases(30, clock=lambda: 0.0)
    leases.grant(3, Hit(7, 4, "ResidentKv"), b"scope", [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError):
        leases.grant(3, Hit(8, 4, "ResidentKv"), b"scope", [1, 2, 3, 4])
    lease = leases.take(3)
    assert leases.take(3) is None and len(leases) == 0
    assert lease.serves(b"scope", [1, 2, 3, 4, 9], 4)
    assert not lease.serves(b"other", [1, 2, 3, 4, 9], 4)      # another tenant
    assert not lease.serves(b"scope", [1, 2, 3, 5, 9], 4)      # other tokens
    assert not lease.serves(b"scope", [1, 2, 3, 4, 9], 3)      # another start


def test_leases_expire_after_their_time():
    now = [0.0]
    leases = Leases(30, clock=lambda: now[0])
    leases.grant(1, Hit(1, 4, "KvRecurrent"), b"s", [0] * 4)
    now[0] = 10.0
    leases.grant(2, Hit(2, 4, "KvRecurrent"), b"s", [1] * 4)
    now[0] = 35.0
    assert [lease.hit.entry_id for lease in leases.take_expired()] == [1]
    assert len(leases) == 1 and leases.expired == 1
    with pytest.raises(ValueError):
        Leases(0)
