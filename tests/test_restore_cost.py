"""Restore only where it pays (cache/restore_cost.py): a hit against the rows it saves."""

from __future__ import annotations

import pytest

from skippy.cache.restore_cost import RestoreCosts


def test_a_restore_is_taken_until_both_costs_are_measured():
    c = RestoreCosts()
    assert c.pays("cold", 1000, 1)
    c.prefilled(100, 1.0)          # 10 ms a row
    assert c.pays("cold", 1000, 1)  # the tier's cost not measured yet
    assert not c.pays("cold", 1000, 0)  # nothing saved: never


@pytest.mark.parametrize("saved, pays", [(64, True), (2, False)])
def test_a_restore_pays_when_it_beats_the_rows_it_saves(saved, pays):
    c = RestoreCosts()
    c.prefilled(100, 1.0)                  # 10 ms a row
    c.restored("cold", 1000, 0.1)          # 0.1 ms a token: 1000 tokens in 100 ms
    assert c.pays("cold", 1000, saved) is pays   # against 640 ms or 20 ms of rows
    assert c.declined == (0 if pays else 1)
    assert c.pays("ResidentKv", 1000, 2)   # another tier: its own measure (none yet)


def test_measures_are_smoothed():
    c = RestoreCosts()
    c.prefilled(1, 1.0)
    c.prefilled(1, 3.0)
    assert c.row_s == pytest.approx(2.0)
    c.prefilled(0, 5.0)  # no rows: nothing learned
    assert c.row_s == pytest.approx(2.0)
