"""The content-addressed block store: dedupe, refcounts, verification, cap, threads; in
memory, and in a directory a node's stage processes share (cache/block_dir.py)."""

import os
import random
import threading

import pytest
from blake3 import blake3
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from skippy.cache.block_dir import DirBlockStore
from skippy.cache.blocks import (BLOCK_SIZE, BlockError, BlockStore, CorruptBlock, MissingBlock,
                                 StoreFull)


@pytest.fixture(params=["memory", "directory", "compressed"])
def make_store(request, tmp_path):
    """Makes stores of one kind; directory stores made by one test share one directory."""
    if request.param == "memory":
        yield BlockStore
        return
    made = []

    def make(max_bytes=0):
        made.append(DirBlockStore(tmp_path / "node", max_bytes,
                                  compress=request.param == "compressed"))
        return made[-1]
    yield make
    for store in made:
        store.close()


def test_block_key_is_the_blake3_digest_of_its_bytes(make_store):
    store = make_store()
    h = store.put(b"hello")
    assert h == blake3(b"hello").digest() and len(h) == 32
    assert store.get(h) == b"hello" and store.has(h)


def test_identical_bytes_are_stored_once_and_counted_per_reference(make_store):
    store = make_store()
    a = store.put(b"x" * 1000)
    assert store.put(bytearray(b"x" * 1000)) == a
    store.put(b"y" * 10)
    s = store.stats()
    assert (s.blocks, s.physical_bytes, s.logical_bytes, s.saved_bytes) == (2, 1010, 2010, 1000)
    assert (s.puts, s.dedup_puts) == (3, 1)
    assert store.refs(a) == 2


def test_block_holds_one_to_block_size_bytes(make_store):
    store = make_store()
    store.put(bytes(BLOCK_SIZE))
    with pytest.raises(ValueError):
        store.put(b"")
    with pytest.raises(ValueError):
        store.put(bytes(BLOCK_SIZE + 1))


def test_store_keeps_its_own_copy_of_a_reused_buffer(make_store):
    store = make_store()
    buf = bytearray(b"abc")
    h = store.put(buf)
    buf[0] = ord("z")
    assert store.get(h) == b"abc"


def test_block_is_freed_with_its_last_reference(make_store):
    store = make_store()
    h = store.put(b"shared")
    store.put(b"shared")
    store.release(h)
    assert store.get(h) == b"shared"
    store.release(h)
    assert not store.has(h)
    with pytest.raises(MissingBlock):
        store.get(h)
    with pytest.raises(MissingBlock):  # released more often than put
        store.release(h)
    s = store.stats()
    assert (s.blocks, s.physical_bytes, s.logical_bytes) == (0, 0, 0)


def test_get_of_unknown_digest_is_a_missing_block_and_a_key_error(make_store):
    store = make_store()
    with pytest.raises(KeyError) as info:
        store.get(bytes(32))
    assert isinstance(info.value, MissingBlock) and isinstance(info.value, BlockError)
    s = store.stats()
    assert (s.gets, s.misses, s.hits) == (1, 1, 0)


def test_flipped_bit_is_detected_on_read_and_the_block_dropped(make_store):
    store = make_store()
    h = store.put(b"state bytes" * 100)
    store.put(b"state bytes" * 100)
    store._corrupt_for_test(h, offset=7)
    with pytest.raises(CorruptBlock) as info:
        store.get(h)
    assert info.value.digest == h
    assert not store.has(h)
    with pytest.raises(MissingBlock):  # dropped: later reads miss rather than re-verify
        store.get(h)
    s = store.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt_reads) == (2, 0, 1, 1)
    assert (s.blocks, s.physical_bytes, s.logical_bytes) == (0, 0, 0)
    # The payloads that held references can still release them.
    assert store.refs(h) == 2
    store.release(h)
    store.release(h)
    assert store.refs(h) == 0


def test_put_of_good_bytes_restores_a_dropped_block_with_its_references(make_store):
    store = make_store()
    data = b"k" * 4096
    h = store.put(data)
    store._corrupt_for_test(h)
    with pytest.raises(CorruptBlock):
        store.get(h)
    assert store.put(data) == h  # e.g. the state was recomputed and exported again
    assert store.get(h) == data and store.refs(h) == 2
    s = store.stats()
    assert (s.blocks, s.physical_bytes, s.logical_bytes) == (1, 4096, 8192)


def test_put_of_good_bytes_heals_a_block_rotted_in_place():
    store = BlockStore()
    h = store.put(b"v" * 64)
    store._corrupt_for_test(h)
    store.put(b"v" * 64)
    assert store.get(h) == b"v" * 64


def test_cap_refuses_a_new_block_and_leaves_the_store_unchanged(make_store):
    store = make_store(max_bytes=3000)
    a = store.put(b"a" * 1000)
    b = store.put(b"b" * 1500)
    before = store.stats()
    with pytest.raises(StoreFull):
        store.put(b"c" * 600)
    after = store.stats()
    assert after.refused_puts == before.refused_puts + 1
    assert (after.blocks, after.physical_bytes, after.logical_bytes, after.puts) == (
        before.blocks, before.physical_bytes, before.logical_bytes, before.puts)
    assert store.get(a) == b"a" * 1000 and store.get(b) == b"b" * 1500  # nothing evicted
    store.put(b"a" * 1000)  # a reference to a held block costs no physical bytes
    store.release(b)
    store.put(b"c" * 600)  # fits once the caller has released something
    assert store.stats().physical_bytes == 1600


def test_negative_cap_is_rejected():
    with pytest.raises(ValueError):
        BlockStore(max_bytes=-1)


class StoreAgainstOracle(RuleBasedStateMachine):
    """Random puts, gets, releases and corruptions against a dict of refcounts."""

    def __init__(self):
        super().__init__()
        self.store = BlockStore(max_bytes=2500)
        self.refs: dict[bytes, int] = {}     # digest -> references held
        self.content: dict[bytes, bytes] = {}
        self.dropped: set[bytes] = set()     # corrupt, referenced, not yet put again

    @rule(data=st.sampled_from([b"a" * 700, b"b" * 900, b"c" * 1100, b"d"]))
    def put(self, data):
        h = blake3(data).digest()
        held = sum(len(self.content[d]) for d, n in self.refs.items() if n and d not in self.dropped)
        grows = not self.refs.get(h) or h in self.dropped
        if grows and held + len(data) > 2500:
            with pytest.raises(StoreFull):
                self.store.put(data)
            return
        assert self.store.put(data) == h
        self.refs[h] = self.refs.get(h, 0) + 1
        self.content[h] = data
        self.dropped.discard(h)

    @precondition(lambda self: any(self.refs.values()))
    @rule(pick=st.randoms(use_true_random=False))
    def release(self, pick):
        h = pick.choice(sorted(d for d, n in self.refs.items() if n))
        self.store.release(h)
        self.refs[h] -= 1
        if not self.refs[h]:
            self.dropped.discard(h)

    @precondition(lambda self: any(self.refs.values()))
    @rule(pick=st.randoms(use_true_random=False))
    def get(self, pick):
        h = pick.choice(sorted(d for d, n in self.refs.items() if n))
        if h in self.dropped:
            with pytest.raises(MissingBlock):
                self.store.get(h)
        else:
            assert self.store.get(h) == self.content[h]

    @precondition(lambda self: any(n and d not in self.dropped for d, n in self.refs.items()))
    @rule(pick=st.randoms(use_true_random=False))
    def corrupt_then_read(self, pick):
        h = pick.choice(sorted(d for d, n in self.refs.items() if n and d not in self.dropped))
        self.store._corrupt_for_test(h, offset=pick.randrange(1 << 20))
        with pytest.raises(CorruptBlock):
            self.store.get(h)
        self.dropped.add(h)

    @invariant()
    def stats_match_the_oracle(self):
        live = {d: n for d, n in self.refs.items() if n and d not in self.dropped}
        s = self.store.stats()
        assert s.blocks == len(live)
        assert s.physical_bytes == sum(len(self.content[d]) for d in live)
        assert s.logical_bytes == sum(n * len(self.content[d]) for d, n in live.items())
        assert s.saved_bytes == s.logical_bytes - s.physical_bytes
        assert s.gets == s.hits + s.misses + s.corrupt_reads
        for d, n in self.refs.items():
            assert self.store.refs(d) == n
            assert self.store.has(d) == (d in live)


TestStoreAgainstOracle = StoreAgainstOracle.TestCase
TestStoreAgainstOracle.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_concurrent_puts_gets_and_releases_end_consistent(make_store):
    store = make_store()
    pool = [bytes([i]) * (1000 + 37 * i) for i in range(12)]  # shared: threads dedupe onto each other
    n_threads, rounds = 8, 300
    errors = []
    held_at_barrier = [None] * n_threads
    puts = [0] * n_threads
    barrier = threading.Barrier(n_threads + 1)
    resume = threading.Event()

    def worker(idx):
        rng = random.Random(idx)
        held = []
        try:
            for _ in range(rounds):
                if held and rng.random() < 0.4:
                    store.release(held.pop(rng.randrange(len(held))))
                else:
                    data = rng.choice(pool)
                    held.append(store.put(data))
                    puts[idx] += 1
                h = rng.choice(held) if held else None
                if h is not None:
                    assert blake3(store.get(h)).digest() == h
            held_at_barrier[idx] = list(held)
            barrier.wait()
            resume.wait()
            for h in held:
                store.release(h)
        except Exception as e:  # surfaced below; a failing thread must not hang the barrier
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait(timeout=30)
    size = {blake3(d).digest(): len(d) for d in pool}
    held = [h for hs in held_at_barrier for h in hs]
    s = store.stats()
    assert s.logical_bytes == sum(size[h] for h in held)
    assert s.physical_bytes == sum(size[h] for h in set(held))
    assert s.blocks == len(set(held))
    resume.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    s = store.stats()
    assert (s.blocks, s.physical_bytes, s.logical_bytes) == (0, 0, 0)
    assert s.gets == s.hits and s.corrupt_reads == 0
    assert s.puts == sum(puts)


# -- one directory, several owners: the stage processes of a node --------------------------
def test_owners_of_a_node_share_one_copy_and_the_last_one_frees_it(tmp_path):
    a, b = DirBlockStore(tmp_path), DirBlockStore(tmp_path)
    data = bytes(range(256)) * 100
    h = a.put(data)
    assert b.put(data) == h and b.linked_puts == 1            # linked, not written again
    assert a.node_stats() == {"node_blocks": 1, "node_physical_bytes": len(data)}
    c = DirBlockStore(tmp_path)
    assert c.has(h) and c.get(h) == data and not c.refs(h)  # the node's, not c's own
    a.release(h)
    assert b.get(h) == data and b.node_stats()["node_blocks"] == 1
    b.release(h)
    assert b.node_stats() == {"node_blocks": 0, "node_physical_bytes": 0}


def test_a_dead_owners_blocks_are_swept_by_the_next_to_open(tmp_path):
    dead = DirBlockStore(tmp_path, owner="999999999-dead")    # no such pid
    h = dead.put(b"left behind")
    alive = DirBlockStore(tmp_path)
    assert alive.node_stats()["node_blocks"] == 0 and not alive.has(h)
    assert not (tmp_path / "refs" / "999999999-dead").exists()


def test_an_owner_whose_pid_a_later_process_took_is_swept(tmp_path):
    """The owner's pid alive (this very process) but started at another time: a reused pid,
    whose blocks would otherwise hold tmpfs memory for as long as the new process lives."""
    pid = os.getpid()
    reused = DirBlockStore(tmp_path, owner=f"{pid}-1-a1b2c3d4")  # started at tick 1: not us
    h = reused.put(b"left behind by the pid's former process")
    mine = DirBlockStore(tmp_path)
    assert mine.owner.startswith(f"{pid}-") and mine.owner.split("-")[1] != "1"
    assert not (tmp_path / "refs" / reused.owner).exists() and not mine.has(h)
    kept = mine.put(b"held by a live owner")
    DirBlockStore(tmp_path)  # a third owner opens the folder: the live one's block stays
    assert mine.get(kept) == b"held by a live owner"
    assert (tmp_path / "refs" / mine.owner).is_dir()


def test_rotten_bytes_are_never_linked_by_another_owner(tmp_path):
    a, b = DirBlockStore(tmp_path), DirBlockStore(tmp_path)
    data = b"x" * 5000
    h = a.put(data)
    a._corrupt_for_test(h)
    with pytest.raises(CorruptBlock):
        a.get(h)
    assert b.put(data) == h and b.linked_puts == 0 and b.get(h) == data
