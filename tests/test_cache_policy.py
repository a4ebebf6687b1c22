"""The cache policy object is chosen once, from the family's policy name and whether the
runtime's lanes may hold entries."""

from __future__ import annotations

import pytest

from skippy.stages.cache_policy import (Disabled, RecurrentSnapshots, ResidentLanes,
                                        StoredPayloads, policy_class)


class Runtime:
    def __init__(self, lane_entries: bool):
        self.lane_entries = lane_entries


@pytest.mark.parametrize("name, lane_entries, enabled, chosen", [
    ("ResidentKv", True, True, ResidentLanes),
    ("ResidentKv", False, True, StoredPayloads),     # llama.cpp: few lanes
    ("KvRecurrent", True, True, RecurrentSnapshots),
    ("KvRecurrent", False, True, RecurrentSnapshots),
    ("disabled", True, True, Disabled),
    ("ResidentKv", True, False, Disabled),           # the cache is turned off
])
def test_policy_is_chosen_by_name_and_runtime(name, lane_entries, enabled, chosen):
    assert policy_class(name, Runtime(lane_entries), enabled) is chosen


def test_names_and_flags_of_each_policy():
    assert [c.name for c in (ResidentLanes, StoredPayloads, RecurrentSnapshots, Disabled)] \
        == ["ResidentKv", "ResidentKv", "KvRecurrent", "disabled"]
    assert RecurrentSnapshots.whole_entry and not ResidentLanes.whole_entry
    assert StoredPayloads.stores_payloads and not ResidentLanes.stores_payloads
    assert not Disabled.enabled


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown cache policy"):
        policy_class("FullState", Runtime(True))
