import pytest

from skippy.topology.planner import PlanError, even_ranges


@pytest.mark.parametrize("layers, stages", [(30, 1), (30, 2), (30, 7), (18, 5), (5, 5)])
def test_even_ranges_cover_all_layers_contiguously(layers, stages):
    ranges = even_ranges(layers, stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(stages - 1))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("stages", [0, -1, 31])
def test_impossible_splits_are_refused(stages):
    with pytest.raises(PlanError):
        even_ranges(30, stages)
