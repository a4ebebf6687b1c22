"""Many threads on one cache object at once, with caps small enough that every operation
competes with evictions; afterwards nothing is lost, leaked or counted twice.

PrefixCache: every entry id ever reserved ends up exactly one of: still live, evicted (in
some Reservation.evicted), freed (a remove/clear/release return value), refused at commit
(another reservation recorded the same identity first) or aborted; the live ones are
exactly what the cache holds, byte for byte, and no hit is freed under its reader.
BlockStore: once every payload is released, no block and no byte is left.
ActivationCache: what `get` finds is exactly what the stats count.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from skippy.cache.activation import ActivationCache, activation_key
from skippy.cache.admission import PrefixAdmission
from skippy.cache.blocks import BlockError, BlockStore, StoreFull
from skippy.cache.payload import (
    PayloadKind,
    decode_payload,
    encode_payload,
    release_payload,
)
from skippy.cache.prefix_cache import PrefixCache

BLOCK = 4
MAX_ENTRIES = 6
MAX_BYTES = 100
MAX_TOKENS = 24
STAGES = (b"stage-a", b"stage-b")
STEMS = ((), (1,), (1, 2, 0, 1), (1, 2, 0, 1, 2, 2, 0, 1), (2, 0, 0, 1, 1, 2, 0, 2, 1, 0, 0, 2))


@pytest.fixture(autouse=True)
def frequent_thread_switches():
    """Switch threads every 10 us instead of 5 ms: many more interleavings per second."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def run_threads(workers: list[Callable[[random.Random, float], None]], seconds: float) -> None:
    """Run each worker(rng, deadline) in its own thread; re-raise the first failure."""
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def wrap(i, fn):
        try:
            fn(random.Random(i), deadline)
        except BaseException as e:  # noqa: BLE001  reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i, fn)) for i, fn in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
        assert not t.is_alive(), "a worker is stuck (deadlock?)"
    if errors:
        raise errors[0]


def tokens_st(rng: random.Random, aligned: bool) -> tuple[int, ...]:
    """A stem, then a short tail over a 3-token alphabet: deep sharing, many duplicates."""
    tokens = STEMS[rng.randrange(len(STEMS))] + tuple(rng.randrange(3) for _ in range(rng.randrange(10)))
    if aligned:
        tokens = tokens[: len(tokens) // BLOCK * BLOCK] or (0,) * BLOCK
        if rng.random() < 0.05:
            tokens += (1,) * (MAX_TOKENS + BLOCK - len(tokens))   # longer than max_tokens
    return tokens


def first_token_hash(parent: bytes, run: bytes) -> bytes:
    # Collides constantly: every hash hit must be verified and most fall back to a scan.
    return bytes([run[0]]) + b"\x00" * 15


class Ledger:
    """What the threads saw, appended to concurrently (list.append is atomic)."""

    def __init__(self):
        self.reserved: dict[int, tuple[bytes, tuple[int, ...], int]] = {}
        self.evicted: list[int] = []
        self.freed: list[int] = []
        self.freed_now: set[int] = set()   # evicted or freed, for the readers' checks
        self.committed: list[int] = []
        self.refused: list[int] = []       # commit returned False
        self.aborted: list[int] = []
        self.reserve_calls = self.reserve_none = 0
        self.lookups = self.probes = self.hits = self.hit_tokens = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()       # only for the integer tallies

    def gone(self, ids, into: list[int]) -> None:
        into.extend(ids)
        self.freed_now.update(ids)


@pytest.mark.parametrize("whole_entry,hash_fn,admit", [
    (False, None, False),
    (True, None, True),
    (False, first_token_hash, False),
], ids=["kv-rows", "whole-entry-admission", "colliding-hash"])
def test_prefix_cache_accounts_for_every_entry_under_concurrency(whole_entry, hash_fn, admit):
    cache = PrefixCache(block=BLOCK, max_entries=MAX_ENTRIES, max_bytes=MAX_BYTES,
                        max_tokens=MAX_TOKENS, whole_entry=whole_entry, hash_fn=hash_fn,
                        admission=PrefixAdmission(admit_after=2) if admit else None)
    led = Ledger()
    ids_seen: list[int] = []

    def reader(rng, deadline):
        while time.monotonic() < deadline:
            stage, query = rng.choice(STAGES), tokens_st(rng, aligned=False) + (0, 1)
            if rng.random() < 0.05:
                assert cache.lookup(stage, query, probe=True) is None
                with led.lock:
                    led.probes += 1
                continue
            max_len = rng.choice((None, None, 4, 8, 13))
            hit = cache.lookup(stage, query, max_len=max_len)
            with led.lock:
                led.lookups += 1
                if hit is not None:
                    led.hits += 1
                    led.hit_tokens += hit.length
            if hit is None:
                continue
            limit = len(query) if max_len is None else min(max_len, len(query))
            r_stage, r_tokens, _ = led.reserved[hit.entry_id]
            assert r_stage == stage and 0 < hit.length <= limit and hit.length % BLOCK == 0
            assert r_tokens[:hit.length] == query[:hit.length]
            assert not whole_entry or len(r_tokens) == hit.length
            assert hit.entry_id not in led.freed_now, "entry freed under a pinned reader"
            if rng.random() < 0.3:
                time.sleep(0)   # hold the pin while others evict, remove and clear
            assert hit.entry_id not in led.freed_now, "entry freed under a pinned reader"
            led.gone(cache.release(hit), led.freed)

    def writer(rng, deadline):
        while time.monotonic() < deadline:
            stage, tokens = rng.choice(STAGES), tokens_st(rng, aligned=True)
            nbytes = rng.choice((1, 5, 20, 35, 60, MAX_BYTES + 1))
            r = cache.reserve(stage, tokens, nbytes)
            with led.lock:
                led.reserve_calls += 1
                led.reserve_none += r is None
            if r is None:
                continue
            assert r.entry_id not in led.reserved, "entry id handed out twice"
            led.reserved[r.entry_id] = (stage, tuple(tokens), nbytes)
            ids_seen.append(r.entry_id)
            led.gone(r.evicted, led.evicted)
            if rng.random() < 0.3:
                time.sleep(0)   # a reservation in flight while others clear and remove
            if rng.random() < 0.15:
                cache.abort(r)
                led.aborted.append(r.entry_id)
            elif cache.commit(r):
                led.committed.append(r.entry_id)
            else:
                led.refused.append(r.entry_id)

    def remover(rng, deadline):
        while time.monotonic() < deadline:
            if rng.random() < 0.03:
                led.gone(cache.clear(), led.freed)
            elif ids_seen:
                led.gone(cache.remove(rng.choice(ids_seen)), led.freed)
            time.sleep(0)

    def watcher(rng, deadline):
        while time.monotonic() < deadline:
            s = cache.stats()
            c = s.counters
            assert s.entries <= MAX_ENTRIES
            assert s.resident_bytes + s.reserved_bytes <= MAX_BYTES
            assert 0 <= s.evictable_bytes <= s.resident_bytes
            assert s.pinned_entries <= s.entries
            assert c["hits"] + c["misses"] == c["lookups"]
            assert c["records"] <= c["admissions"]
            time.sleep(0)

    run_threads([reader, reader, reader, writer, writer, remover, watcher], seconds=0.7)

    # -- every id is accounted for exactly once ----------------------------------------
    gone = Counter(led.evicted) + Counter(led.freed)
    assert not [eid for eid, n in gone.items() if n > 1], "an entry freed twice"
    assert set(gone) <= set(led.reserved), "freed an id never handed out"
    committed, refused, aborted = set(led.committed), set(led.refused), set(led.aborted)
    assert len(committed) + len(refused) + len(aborted) == len(led.reserved)
    assert set(led.evicted) <= committed, "evicted an entry that was never readable"
    live = committed - set(gone)
    dup_refusals = refused - set(gone)   # refused because the identity was recorded first

    s = cache.stats()
    c = s.counters
    assert s.entries == len(live)
    assert s.pinned_entries == 0 and s.reserved_bytes == 0
    assert s.resident_bytes == s.evictable_bytes == sum(led.reserved[e][2] for e in live)
    for eid, (stage, tokens, _) in led.reserved.items():   # the index holds exactly `live`
        if eid in live:
            assert cache.tokens(eid) == tokens
        else:
            with pytest.raises(KeyError):
                cache.tokens(eid)
    live_identities = [(led.reserved[e][0], led.reserved[e][1]) for e in live]
    assert len(set(live_identities)) == len(live_identities), "one identity recorded twice"

    # -- counters agree with what the threads saw -----------------------------------------
    assert c["lookups"] == led.lookups and c["probes"] == led.probes
    assert c["hits"] == led.hits and c["hit_tokens"] == led.hit_tokens
    assert c["hits"] + c["misses"] == c["lookups"]
    assert c["admissions"] == len(led.reserved) == led.reserve_calls - led.reserve_none
    assert c["records"] == len(committed)
    assert c["evictions"] == len(led.evicted)
    assert c["refreshes"] + c["bypasses"] + c["not_admitted"] == led.reserve_none + len(dup_refusals)
    freed_committed = len(committed & set(led.freed))
    assert s.entries == c["records"] - c["evictions"] - freed_committed
    assert led.hits > 0 and c["evictions"] > 0 and freed_committed > 0
    if hash_fn is not None:
        assert c["collisions"] > 0
    if admit:
        assert c["not_admitted"] > 0

    # -- clear() with no pins empties it ----------------------------------------------
    assert set(cache.clear()) == live
    s = cache.stats()
    assert s.entries == 0 and s.resident_bytes == s.reserved_bytes == s.evictable_bytes == 0
    for stage in STAGES:
        assert cache.lookup(stage, (1, 2, 0, 1, 2, 2, 0, 1)) is None


# -- block store and payloads ----------------------------------------------------------------
ROW = 4096            # bytes per token: 256 tokens per 1 MiB page
STORE_CAP = 6 << 20   # small enough that puts are refused now and then


def payload_rows(tokens: tuple[int, ...]) -> np.ndarray:
    """Rows that depend only on (token, position): prompts sharing a stem share pages."""
    t = np.asarray(tokens, dtype=np.int64)[:, None]
    pos = np.arange(len(tokens), dtype=np.int64)[:, None]
    return ((t * 31 + pos * 7 + np.arange(ROW)) % 251).astype(np.uint8)


def payload_tokens(rng: random.Random) -> tuple[int, ...]:
    stem = (7,) * 256 if rng.random() < 0.7 else (9,) * 256
    return stem + tuple(rng.randrange(4) for _ in range(rng.randrange(1, 400)))


def test_block_store_frees_every_block_once_payloads_are_released():
    store = BlockStore(max_bytes=STORE_CAP)
    tally = Counter()
    held_digests: list[bytes] = []

    def worker(rng, deadline):
        held = []
        while time.monotonic() < deadline:
            if len(held) < 3 and rng.random() < 0.6:
                tokens = payload_tokens(rng)
                try:
                    m = encode_payload(PayloadKind.ResidentKv, bytes(32), {"n": len(tokens)},
                                       {"k": payload_rows(tokens)}, {}, len(tokens), store)
                except StoreFull:
                    tally["refused"] += 1
                    continue
                held.append((m, tokens))
                held_digests.extend(m.blocks)
                tally["encoded"] += 1
            elif held and rng.random() < 0.5:
                m, tokens = rng.choice(held)
                try:
                    rows, fixed = decode_payload(m, store)
                except BlockError:   # corrupted (dropped) meanwhile: a miss, recompute
                    tally["missed"] += 1
                    continue
                assert not fixed and np.array_equal(rows["k"], payload_rows(tokens))
                tally["decoded"] += 1
            elif held:
                m, _ = held.pop(rng.randrange(len(held)))
                release_payload(m, store)
        for m, _ in held:
            release_payload(m, store)

    def corruptor(rng, deadline):
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if held_digests:
                try:
                    store._corrupt_for_test(rng.choice(held_digests), rng.randrange(1 << 20))
                except (KeyError, TypeError):   # released, or already dropped as corrupt
                    pass

    def watcher(rng, deadline):
        while time.monotonic() < deadline:
            s = store.stats()
            assert 0 <= s.physical_bytes <= STORE_CAP and s.blocks >= 0
            assert s.logical_bytes >= s.physical_bytes and s.saved_bytes >= 0
            # `gets` is counted before the block is hashed and its outcome after, so a
            # snapshot taken meanwhile shows reads still in flight; equal once all return.
            assert s.gets >= s.hits + s.misses + s.corrupt_reads
            time.sleep(0.001)

    run_threads([worker, worker, worker, corruptor, watcher], seconds=1.5)

    s = store.stats()
    assert s.blocks == 0 and s.physical_bytes == 0 and s.logical_bytes == 0
    assert s.saved_bytes == 0
    assert s.gets == s.hits + s.misses + s.corrupt_reads
    assert tally["encoded"] > 0 and tally["decoded"] > 0 and s.dedup_puts > 0
    for d in set(held_digests):
        assert not store.has(d) and store.refs(d) == 0


# -- activation frames ----------------------------------------------------------------------
ACT_MAX_ENTRIES, ACT_MAX_BYTES = 8, 200
PAGES, WIDTHS = [f"{i:016x}" for i in range(20)], (8, 16)


def frame_bytes(page: str, width: int) -> int:
    n = (int(page, 16) * 13 + width) % 61 + 1
    return ACT_MAX_BYTES + 1 if n > 58 else n   # a few frames never fit: bypassed


def test_activation_cache_counts_match_its_contents_under_concurrency():
    cache = ActivationCache(max_entries=ACT_MAX_ENTRIES, max_bytes=ACT_MAX_BYTES)
    tally = Counter()
    lock = threading.Lock()

    def worker(rng, deadline):
        while time.monotonic() < deadline:
            page, width = rng.choice(PAGES), rng.choice(WIDTHS)
            op = rng.random()
            if op < 0.45:
                stored = cache.put_frame(page, width, (page, width), frame_bytes(page, width))
                assert stored == (frame_bytes(page, width) <= ACT_MAX_BYTES)
                with lock:
                    tally["puts"] += 1
                    tally["bypassed"] += not stored
            elif op < 0.9:
                probe = rng.random() < 0.05
                frame = cache.get_frame(page, width, probe=probe)
                assert frame is None or frame == (page, width)
                with lock:
                    tally["probes" if probe else "gets"] += 1
            elif op < 0.99:
                cache.remove(activation_key(page, width))
            else:
                cache.clear()

    def watcher(rng, deadline):
        while time.monotonic() < deadline:
            s = cache.stats()
            assert s.entries <= ACT_MAX_ENTRIES and s.resident_bytes <= ACT_MAX_BYTES
            assert s.reserved_bytes == 0 and s.pinned_entries == 0
            assert s.counters["hits"] + s.counters["misses"] == s.counters["lookups"]
            time.sleep(0)

    run_threads([worker, worker, worker, worker, watcher], seconds=0.8)

    c = cache.stats().counters
    assert c["lookups"] == tally["gets"] and c["probes"] == tally["probes"]
    assert c["records"] + c["refreshes"] + c["bypasses"] == tally["puts"]
    assert c["bypasses"] == tally["bypassed"] > 0 and c["evictions"] > 0
    present = [(p, w) for p in PAGES for w in WIDTHS if cache.get_frame(p, w) is not None]
    s = cache.stats()
    assert s.entries == len(cache) == len(present)
    assert s.resident_bytes == s.evictable_bytes == sum(frame_bytes(p, w) for p, w in present)
    assert c["records"] - c["evictions"] >= s.entries
    cache.clear()
    s = cache.stats()
    assert s.entries == len(cache) == 0 and s.resident_bytes == 0
