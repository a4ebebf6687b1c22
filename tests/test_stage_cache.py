"""Stages serving from exact caches: cache on must equal cache off, bit for bit."""

from __future__ import annotations

import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.evals.cache_exactness import run_one
from skippy.mesh.control.local import InProcessEngine
from skippy.stages.stage_cache import WARM_LANES, StageCache

STEM = [(i * 7919) % 40000 + 100 for i in range(200)]
PROMPTS = [STEM + [5, 6, 7], STEM + [8, 9] * 20, STEM[:150] + [11] * 30, STEM + [5, 6, 7],
           STEM + [8, 9] * 20 + [1, 2, 3]]


def cfg(**kw) -> CacheConfig:
    return CacheConfig(**{"chunk": 32, "stride": 32, "min_prefix": 32, "admit_after": 1, **kw})


def first_logits_and_tokens(engine: InProcessEngine, ids: list[int]):
    """(first-token logits, 8 greedy tokens, prompt tokens reused)."""
    return run_one(engine, ids)


def engine(path, stages: int, cache: CacheConfig | None = None, **kw) -> InProcessEngine:
    """Caches as given, or off (the same chunk)."""
    return InProcessEngine(path, stages, cache=cache or cfg(enabled=False),
                           **{"n_ctx": 1024, "wire_dtype": "f32", **kw})


def cache_stats(e: InProcessEngine) -> list[dict]:
    return e.stats()["stages"]


def drop_warm_lanes(e: InProcessEngine) -> None:
    """Later hits must come from the cache entries, not a lane left warm."""
    for s in e.servers:
        s.loop.call(s.cache.drop_warm_lanes)


@pytest.mark.parametrize("model, stages", [("qwen3_f32", 1), ("qwen3_f32", 3), ("smollm2", 2),
                                           ("lfm2_f32", 1), ("lfm2_f32", 3),
                                           ("falcon_h1_f32", 2)])
def test_cache_on_equals_cache_off(model, stages, request):
    path = request.getfixturevalue(model)
    off = engine(path, stages, n_ctx=1024)
    on = engine(path, stages, cfg())
    reused_total = 0
    for ids in PROMPTS:
        want_logits, want_tokens, _ = first_logits_and_tokens(off, ids)
        got_logits, got_tokens, reused = first_logits_and_tokens(on, ids)
        assert got_tokens == want_tokens
        assert torch.equal(got_logits, want_logits)
        reused_total += reused
    assert reused_total > 0
    stats = cache_stats(on)
    assert all(s["counters"]["hits"] > 0 for s in stats)


@pytest.mark.parametrize("model, stages", [("qwen3_f32", 2), ("smollm2", 1)])
def test_the_next_turn_reuses_the_reply_to_the_token(model, stages, request):
    """Row-invariant stages (int4 on our kernel): the next turn resumes where the lanes'
    rows end, past rows made by decode and off any chunk boundary, computes only what
    follows, and answers bitwise as with the caches off."""
    path = request.getfixturevalue(model)
    off = engine(path, stages, weight_format="int4")
    on = engine(path, stages, cfg(), weight_format="int4")
    first = STEM[:77]
    _, reply, _ = first_logits_and_tokens(on, first)
    turn = first + reply + [11, 12, 13]
    want_logits, want_tokens, _ = first_logits_and_tokens(off, turn)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, turn)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == len(first) + len(reply) - 1  # the last reply token was never fed
    shorter = first[:70] + [9]  # a prefix of what a lane holds: reused to the token
    want_logits, want_tokens, _ = first_logits_and_tokens(off, shorter)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, shorter)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == 70


def test_entries_serve_any_shared_prefix_to_the_token(qwen3_f32):
    """Row-invariant stages: an entry holds its whole prompt and serves any prefix of it
    a later request shares, off every stride boundary, bitwise as with the caches off."""
    off = engine(qwen3_f32, 2, weight_format="int4")
    on = engine(qwen3_f32, 2, cfg(), weight_format="int4")
    first_logits_and_tokens(on, STEM[:150] + [1, 2, 3])
    drop_warm_lanes(on)                      # the hit must come from an entry
    later = STEM[:141] + [9, 9]
    want_logits, want_tokens, _ = first_logits_and_tokens(off, later)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, later)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == 141                     # not 128, the stride multiple below
    assert all(s["counters"]["hits"] > 0 for s in cache_stats(on))


def test_a_stem_shorter_than_the_stride_is_reused_from_an_entry(qwen3_f32):
    """Row-invariant stages: a request that shares only a short stem with an entry (a
    system prompt under a stride) takes those rows from it, bitwise as with the caches
    off; under 8 tokens, nothing."""
    off = engine(qwen3_f32, 2, weight_format="int4")
    on = engine(qwen3_f32, 2, cfg(), weight_format="int4")
    first_logits_and_tokens(on, STEM[:150] + [1, 2, 3])
    for shared, reuse in ((20, 20), (7, 0)):
        drop_warm_lanes(on)                  # the hit must come from an entry
        later = STEM[:shared] + [9, 9, 9]
        want_logits, want_tokens, _ = first_logits_and_tokens(off, later)
        got_logits, got_tokens, reused = first_logits_and_tokens(on, later)
        assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
        assert reused == reuse


def test_a_hybrid_lane_resumes_where_its_prefill_calls_ended(lfm2_f32):
    """A row-invariant hybrid lane keeps its recurrent state at its last calls' ends (no
    cache entry: nothing is admitted here): a prompt that changes the tail resumes at the
    last of them within what it shares, bitwise as with the caches off."""
    off = engine(lfm2_f32, 2, weight_format="int4")
    on = engine(lfm2_f32, 2, cfg(admit_after=100), weight_format="int4")
    first_logits_and_tokens(on, STEM[:150] + [1, 2, 3])
    later = STEM[:141] + [9, 9]
    want_logits, want_tokens, _ = first_logits_and_tokens(off, later)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, later)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == 128                      # calls of 32 rows: the last end within 141


@pytest.mark.parametrize("model", ["qwen3_f32", "lfm2_f32"])
def test_the_end_of_a_prompt_serves_its_next_turn(model, request):
    """Row-invariant stages record the state at the prompt's end (a hybrid's recurrent
    state too, not only at stride boundaries): the next turn, its lane gone, resumes
    there, bitwise as with the caches off."""
    path = request.getfixturevalue(model)
    off = engine(path, 2, weight_format="int4")
    on = engine(path, 2, cfg(), weight_format="int4")
    first = STEM[:77]
    _, reply, _ = first_logits_and_tokens(on, first)
    drop_warm_lanes(on)
    turn = first + reply + [11, 12, 13]
    want_logits, want_tokens, _ = first_logits_and_tokens(off, turn)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, turn)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == len(first)


@pytest.mark.parametrize("model", ["qwen3_f32", "lfm2_f32"])
def test_a_conversation_pushed_out_of_the_warm_lanes_keeps_its_reply(model, request):
    """More conversations than warm lanes: the oldest one's rows (those made by decode
    included) become a cache entry, the lane itself for KV, a payload of its state for a
    hybrid, so its next turn still computes only the new rows."""
    path = request.getfixturevalue(model)
    off = engine(path, 2, weight_format="int4")
    on = engine(path, 2, cfg(), weight_format="int4")
    firsts = [[1000 + k] + STEM[:70] for k in range(WARM_LANES + 2)]
    replies = [first_logits_and_tokens(on, ids)[1] for ids in firsts]
    turn = firsts[0] + replies[0] + [11, 12, 13]
    want_logits, want_tokens, _ = first_logits_and_tokens(off, turn)
    got_logits, got_tokens, reused = first_logits_and_tokens(on, turn)
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    assert reused == len(firsts[0]) + len(replies[0]) - 1


def test_small_byte_cap_forces_evictions_and_changes_nothing(qwen3_f32):
    off = engine(qwen3_f32, 2, n_ctx=1024)
    # 3 layers x 2 x 2 heads x 64 x 4 B = 3 KiB a token: room for one ~200-token entry
    on = engine(qwen3_f32, 2, cfg(max_bytes=1_000_000, max_entries=8))
    for ids in PROMPTS * 2:
        assert first_logits_and_tokens(on, ids)[1] == first_logits_and_tokens(off, ids)[1]
    for s in cache_stats(on):
        kv = s["prefix"]
        assert kv["resident_bytes"] + kv["reserved_bytes"] <= 1_000_000
        assert kv["counters"]["evictions"] > 0


def test_exact_repeat_is_served_from_the_result_cache(qwen3_f32):
    on = engine(qwen3_f32, 2, cfg())
    first = first_logits_and_tokens(on, PROMPTS[1])
    again = first_logits_and_tokens(on, PROMPTS[1])
    assert again[2] == len(PROMPTS[1])           # nothing run for the first token
    assert again[1] == first[1] and torch.equal(again[0], first[0])


def test_probes_leave_no_trace(qwen3_f32):
    on = engine(qwen3_f32, 1, cfg())
    on.complete(PROMPTS[0], 2, probe=True)
    s = cache_stats(on)[0]
    assert s["entries"] == 0 and s["counters"]["hits"] == 0 and s["counters"]["records"] == 0


def payload_cache(path, **kw) -> tuple[InProcessEngine, StageCache]:
    """Exported payloads in the block store: the KvRecurrent machinery on a dense model."""
    e = engine(path, 1, cfg(**kw), n_ctx=2048, policy="KvRecurrent")
    return e, e.servers[0].cache


def test_payload_restore_equals_recompute_and_dedupes(qwen3_f32):
    off = engine(qwen3_f32, 1, n_ctx=2048)
    on, cache = payload_cache(qwen3_f32, record_limit=1, max_prefix=2048)
    stem = (STEM * 5)[:960]
    a, b = stem + [1] * 40, stem + [2] * 40          # one 992-token payload each
    for ids in (a, b):
        assert first_logits_and_tokens(on, ids)[1] == first_logits_and_tokens(off, ids)[1]
    manifests = list(cache.entries.manifests.values())
    assert len(manifests) == 2
    store = cache.store.stats()
    larger = max(m.total_bytes for m in manifests)
    print(f"\ntwo payloads of {larger} bytes sharing 960 of 992 tokens: "
          f"{store.physical_bytes} physical bytes ({store.physical_bytes / larger:.2f}x)")
    assert store.physical_bytes < 1.2 * larger
    drop_warm_lanes(on)  # restore from the store, not from a warm lane
    assert first_logits_and_tokens(on, b)[1] == first_logits_and_tokens(off, b)[1]
    assert cache.stats()["prefix"]["counters"]["hits"] > 0


def test_corrupt_block_costs_time_not_correctness(qwen3_f32):
    off = engine(qwen3_f32, 1, n_ctx=1024)
    on, cache = payload_cache(qwen3_f32)
    first_logits_and_tokens(on, PROMPTS[1])
    for manifest in cache.entries.manifests.values():
        for h in manifest.blocks:
            cache.store._corrupt_for_test(h, 0)
    drop_warm_lanes(on)  # no hot lane: force a restore from the store
    got = first_logits_and_tokens(on, PROMPTS[4])
    assert got[1] == first_logits_and_tokens(off, PROMPTS[4])[1]
    assert cache.store.stats().corrupt_reads > 0


def test_hybrid_family_serves_kv_recurrent_payloads(lfm2_f32):
    on = engine(lfm2_f32, 2, cfg())
    assert all(s.cache.policy == "KvRecurrent" for s in on.servers)
    for ids in PROMPTS:
        first_logits_and_tokens(on, ids)
    for s in cache_stats(on):
        assert s["blocks"]["blocks"] > 0 and s["prefix"]["counters"]["records"] > 0


@pytest.mark.parametrize("wire", ["f32", "f16"])
def test_downstream_miss_is_served_from_upstream_frames(qwen3_f32, wire):
    """Stage 0 holds the prefix but stage 1 lost it: stage 0 restores and sends rows
    [0, b) from its frame cache instead of recomputing them; nothing changes."""
    off = engine(qwen3_f32, 2, wire_dtype=wire)
    on = engine(qwen3_f32, 2, cfg(), wire_dtype=wire)
    first_logits_and_tokens(on, PROMPTS[0])
    drop_warm_lanes(on)                      # no warm lanes: hits must come from the caches
    downstream = on.servers[1]
    downstream.loop.call(downstream.cache.clear)  # the downstream stage forgets everything
    want = first_logits_and_tokens(off, PROMPTS[1])
    got = first_logits_and_tokens(on, PROMPTS[1])
    assert got[1] == want[1] and torch.equal(got[0], want[0])
    assert got[2] == 0                       # stage 1 computed every row
    stage0 = cache_stats(on)[0]
    assert stage0["prefix"]["counters"]["hits"] > 0      # stage 0 restored ...
    assert stage0["frames"]["counters"]["hits"] > 0      # ... and sent cached rows down


def test_namespaces_do_not_share_entries(qwen3_f32):
    on = engine(qwen3_f32, 1, cfg())

    def reused(ids, namespace):
        return on.complete(ids, 1, namespace=namespace)[0].cached_tokens
    reused(PROMPTS[0], "tenant-a")
    drop_warm_lanes(on)
    assert reused(PROMPTS[1], "tenant-b") == 0
    drop_warm_lanes(on)
    assert reused(PROMPTS[1], "tenant-a") > 0
    assert reused(PROMPTS[0], "tenant-c") == 0   # an exact repeat, of another tenant


def test_llama_cpp_entries_are_payloads_and_take_no_lane(smollm2):
    """llama.cpp has a fixed number of lanes: its dense entries live in the block store,
    and a hit imports one (cut to the hit's length) bitwise."""
    from skippy.stages.llamacpp_runtime import LlamaCppStageRuntime
    from skippy.stages.runtime import StageError, StageSpec
    rt = LlamaCppStageRuntime(StageSpec(str(smollm2), 0, 30, chunk=32, n_ctx=512), max_lanes=2)
    cache = StageCache(rt, cfg(), policy="ResidentKv")
    a = cache.alloc_lane()
    cold = cache.prefill(a, PROMPTS[0], torch.tensor(PROMPTS[0]), 0).logits
    assert cache.stats()["entries"] == 1 and cache.store.stats().blocks > 0
    b = cache.alloc_lane()                            # the entry holds no lane
    with pytest.raises(StageError):
        cache.alloc_lane()
    cache.free_lane(a)
    start = cache.available(b, PROMPTS[0], len(PROMPTS[0]) - 1)
    assert start > 0 and cache.restore(b, PROMPTS[0], start)
    warm = cache.prefill(b, PROMPTS[0], torch.tensor(PROMPTS[0][start:]), start).logits
    assert torch.equal(warm, cold)
    cache.free_lane(b)
    rt.close()
