"""A plan's cache hit is leased to its lane: no eviction between plan and restore can take
it, the restore is bitwise what a cold prefill computes, and a lease nobody consumes
ends (new plan, prefill, free, expiry) so the entry can be evicted again."""

from __future__ import annotations

import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.stages.cache_policy import RecurrentSnapshots, ResidentLanes, StoredPayloads
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageSpec
from skippy.stages.stage_cache import StageCache
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model

STEM = [(i * 7919) % 40000 + 100 for i in range(200)]
A = STEM + [5, 6, 7]                 # records its first 192 tokens
B = STEM + [8, 9] * 20               # planned from A's entry
OTHERS = [[(i * 31 + k * 977) % 5000 + 200 for i in range(100)] for k in range(2)]


def cfg(**kw) -> CacheConfig:
    # two entries at most, one recorded per prefill: the second other prompt must evict
    return CacheConfig(**{"chunk": 32, "stride": 32, "min_prefix": 32, "admit_after": 1,
                          "record_limit": 1, "max_entries": 2, **kw})


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


POLICIES = {  # policy object -> (model fixture, family policy name, entries held in lanes)
    ResidentLanes: ("qwen3_f32", "ResidentKv", True),
    StoredPayloads: ("qwen3_f32", "ResidentKv", False),
    RecurrentSnapshots: ("lfm2_f32", "KvRecurrent", True),
}


def make_cache(request, policy=ResidentLanes, **kw) -> StageCache:
    model, name, lane_entries = POLICIES[policy]
    path = request.getfixturevalue(model)
    f = open_model(path)
    n_layers = ModelConfig.from_gguf(f).n_layers
    f.close()
    rt = make_runtime(StageSpec(str(path), 0, n_layers, 0, 1, "f32", chunk=32, n_ctx=1024))
    rt.lane_entries = lane_entries
    cache = StageCache(rt, cfg(), policy=name, **kw)
    assert type(cache.entries) is policy
    return cache


def cold(cache: StageCache, ids: list[int]) -> torch.Tensor:
    """Cache off: a fresh runtime lane prefilled from 0."""
    rt = cache.runtime
    lane = rt.alloc_lane()
    try:
        return rt.prefill(lane, torch.tensor(ids), 0).logits
    finally:
        rt.free_lane(lane)


def prefill(cache: StageCache, ids: list[int], lane: int | None = None,
            start: int = 0) -> torch.Tensor:
    """Prefill on `lane` from `start` (a fresh lane, freed afterwards, when None)."""
    own = lane is None
    lane = cache.alloc_lane() if own else lane
    out = cache.prefill(lane, ids, torch.tensor(ids[start:]), start).logits
    if own:
        cache.free_lane(lane)
    return out


def evictions(cache: StageCache) -> int:
    return cache.stats()["prefix"]["counters"]["evictions"]


@pytest.mark.parametrize("policy", list(POLICIES), ids=lambda p: p.__name__)
def test_a_planned_restore_survives_evictions_and_equals_cache_off(request, policy):
    cache = make_cache(request, policy)
    prefill(cache, A)
    lane = cache.alloc_lane(B)
    start = cache.plan(lane, B, len(B) - 1, None)
    assert start == 192 and cache.stats()["leases_held"] == 1
    before = evictions(cache)
    for ids in OTHERS:                  # the second one must evict an entry
        prefill(cache, ids)
    assert evictions(cache) > before
    assert cache.restore(lane, B, start)
    assert torch.equal(prefill(cache, B, lane, start), cold(cache, B))
    s = cache.stats()
    assert s["restore_failures"] == 0 and s["leases_held"] == 0
    assert s["prefix"]["pinned_entries"] == 0
    cache.free_lane(lane)


def test_without_a_lease_the_same_evictions_fail_the_restore(request):
    """The control: `available` pins nothing, so the entry goes and the caller recomputes."""
    cache = make_cache(request)
    prefill(cache, A)
    lane = cache.alloc_lane(B)
    start = cache.available(lane, B, len(B) - 1)
    for ids in OTHERS:
        prefill(cache, ids)
    assert not cache.restore(lane, B, start)
    assert cache.stats()["restore_failures"] == 1
    assert torch.equal(prefill(cache, B, lane, 0), cold(cache, B))
    cache.free_lane(lane)


def test_an_expired_lease_releases_its_entry(request):
    clock = Clock()
    cache = make_cache(request, lease_seconds=30, clock=clock)
    prefill(cache, A)
    lane = cache.alloc_lane(B)
    start = cache.plan(lane, B, len(B) - 1, None)
    clock.now = 29.0
    cache.free_lane(cache.alloc_lane())   # a later call: not expired yet
    assert cache.stats()["prefix"]["pinned_entries"] == 1
    clock.now = 31.0
    cache.free_lane(cache.alloc_lane())   # expiry is checked lazily on later calls
    s = cache.stats()
    assert s["leases_held"] == 0 and s["leases_expired"] == 1
    assert s["prefix"]["pinned_entries"] == 0
    for ids in OTHERS:                    # the entry is evictable again
        prefill(cache, ids)
    assert not cache.restore(lane, B, start)
    assert cache.stats()["restore_failures"] == 1
    assert torch.equal(prefill(cache, B, lane, 0), cold(cache, B))
    cache.free_lane(lane)


@pytest.mark.parametrize("end", ["plan", "prefill", "free_lane"])
def test_a_lease_ends_with_a_new_plan_a_prefill_or_the_lane(request, end):
    cache = make_cache(request)
    prefill(cache, A)
    lane = cache.alloc_lane(B)
    cache.plan(lane, B, len(B) - 1, None)
    assert cache.stats()["prefix"]["pinned_entries"] == 1
    if end == "plan":                     # planned again, for a prompt with no hit
        assert cache.plan(lane, OTHERS[0], len(OTHERS[0]) - 1, None) == 0
    elif end == "prefill":                # the restore was skipped: computed from 0
        prefill(cache, B, lane, 0)
    else:
        cache.free_lane(lane)
    s = cache.stats()
    assert s["leases_held"] == 0 and s["prefix"]["pinned_entries"] == 0
    if end != "free_lane":
        cache.free_lane(lane)


def test_clear_keeps_a_leased_entry_until_its_restore(request):
    cache = make_cache(request)
    prefill(cache, A)
    lane = cache.alloc_lane(B)
    start = cache.plan(lane, B, len(B) - 1, None)
    cache.clear()
    assert cache.restore(lane, B, start)
    assert torch.equal(prefill(cache, B, lane, start), cold(cache, B))
    # A's entry and its lane are gone; only what B's prefill recorded is left
    assert cache.stats()["prefix"]["entries"] == len(cache.entries.holders) == 1
    cache.free_lane(lane)
