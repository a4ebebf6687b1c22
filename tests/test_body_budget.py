"""A caller's budget of request bytes a second (mesh/front/body_budget.py), on a clock the
test moves."""

from __future__ import annotations

import pytest

from skippy.mesh.front.body_budget import MAX_CALLERS, BodyBudget
from skippy.mesh.front.openai_api import ApiError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_then_the_rate_and_a_429_that_says_when():
    clock = Clock()
    budget = BodyBudget(rate=100, burst=300, clock=clock)
    budget.take("a", 300)            # a full burst at once
    with pytest.raises(ApiError) as e:
        budget.take("a", 150)
    err = e.value
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert err.headers == {"Retry-After": "2"}  # 150 bytes at 100 a second
    budget.take("b", 300)            # another caller has its own
    clock.t = 1.0
    with pytest.raises(ApiError):
        budget.take("a", 150)        # 100 refilled: not yet
    clock.t = 1.5
    budget.take("a", 150)            # a refusal spent nothing
    clock.t = 100.0
    budget.take("a", 300)            # never more than the burst is saved up
    with pytest.raises(ApiError):
        budget.take("a", 1)


def test_a_body_larger_than_the_burst_waits_for_a_full_bucket_only():
    clock = Clock()
    budget = BodyBudget(rate=100, burst=300, clock=clock)
    budget.take("a", 300)
    with pytest.raises(ApiError) as e:
        budget.take("a", 10_000)
    assert e.value.headers == {"Retry-After": "3"}


def test_buckets_are_bounded():
    budget = BodyBudget(rate=1, burst=10)
    for i in range(MAX_CALLERS + 5):
        budget.take(str(i), 10)
    assert len(budget._buckets) == MAX_CALLERS
    budget.take("0", 10)  # forgotten: a full bucket again
