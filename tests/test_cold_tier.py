"""The disk tier: an entry the RAM cap pushes out (a resident lane, or a payload) is
demoted to a compressed payload on disk instead of dropped; a later hit restores it
(bitwise as a recompute) and promotes it back to RAM."""

from __future__ import annotations

import pytest
import torch

from skippy.cache.block_dir import DirBlockStore
from skippy.cache.blocks import DIGEST_SIZE
from skippy.cache.config import CacheConfig
from skippy.mesh.stage.server import StageServer
from skippy.stages.runtime import StageSpec
from stage_calls import run

A = [(i * 37 + 11) % 5000 + 10 for i in range(200)]
B = [(i * 53 + 5) % 5000 + 10 for i in range(200)]
A2 = A + [(i * 29 + 3) % 5000 + 10 for i in range(40)]


def server(path, cfg: CacheConfig, cold: DirBlockStore | None = None,
           policy: str = "ResidentKv") -> StageServer:
    return StageServer(StageSpec(str(path), 0, 6, 0, 1, topology_digest="t"), cfg,
                       policy=policy, cold_store=cold)


@pytest.fixture(scope="module", params=["ResidentKv", "KvRecurrent"])
def policy(request):
    return request.param


@pytest.fixture(scope="module")
def entry_bytes(qwen3_f32, policy):
    """What A's entries hold in RAM."""
    s = server(qwen3_f32, CacheConfig(admit_after=1), policy=policy)
    run(s, A)
    nbytes = s.cache.stats()["prefix"]["resident_bytes"]
    s.loop.stop()
    return nbytes


@pytest.mark.parametrize("with_disk", [True, False])
def test_an_evicted_entry_comes_back_from_disk_bitwise(qwen3_f32, policy, entry_bytes,
                                                       tmp_path, with_disk):
    cfg = CacheConfig(admit_after=1, max_bytes=int(entry_bytes * 1.5))  # room for A's
    cold = DirBlockStore(tmp_path, compress=True) if with_disk else None
    on = server(qwen3_f32, cfg, cold, policy)
    off = server(qwen3_f32, CacheConfig(enabled=False), policy=policy)
    try:
        run(on, A)
        run(on, B)                        # B's entry pushes A's out of RAM
        on.cache.drop_warm_lanes()        # no warm lane may serve A: only the tiers
        cached, ids, rows = run(on, A2)
        _, want_ids, want_rows = run(off, A2)
        assert ids == want_ids and all(torch.equal(a, b) for a, b in zip(rows, want_rows))
        stats = on.cache.stats()
        if not with_disk:  # RAM kept at most a shorter one of A's entries
            assert cached < 192 and on.cache.tiers.cold is None
            return
        assert cached == 192
        assert stats["cold"]["counters"]["hits"] == 1
        assert stats["cold_blocks"]["node_physical_bytes"] < stats["cold_blocks"]["physical_bytes"]
        again, _, _ = run(on, A2)         # promoted: RAM serves it now
        assert again >= 192 and on.cache.stats()["cold"]["counters"]["hits"] == 1
    finally:
        on.loop.stop()
        off.loop.stop()
        if cold is not None:
            cold.close()


def test_a_disk_restore_slower_than_recomputing_is_declined(qwen3_f32, policy, entry_bytes,
                                                            tmp_path):
    """Restore only where it pays: with the disk tier measured slower per token than a
    prefill row (set here: this machine's disk is fast), A's entry on disk is left
    alone and its rows recomputed, bitwise the same."""
    cfg = CacheConfig(admit_after=1, max_bytes=int(entry_bytes * 1.5))
    cold = DirBlockStore(tmp_path, compress=True)
    on = server(qwen3_f32, cfg, cold, policy)
    off = server(qwen3_f32, CacheConfig(enabled=False), policy=policy)
    try:
        run(on, A)
        run(on, B)
        on.cache.drop_warm_lanes()
        costs = on.cache.tiers.costs
        costs.restored("cold", 1, 1000 * costs.row_s)  # a token from disk: 1000 rows' time
        cached, ids, rows = run(on, A2)
        _, want_ids, want_rows = run(off, A2)
        assert ids == want_ids and all(torch.equal(a, b) for a, b in zip(rows, want_rows))
        stats = on.cache.stats()
        assert cached < 192 and stats["cold"]["counters"]["hits"] == 1
        assert stats["restores_declined"] == 1
    finally:
        on.loop.stop()
        off.loop.stop()
        cold.close()


def test_every_block_in_ram_or_on_disk_is_one_namespaces(qwen3_f32, policy, entry_bytes,
                                                         tmp_path):
    """Tenants share no block in RAM or on disk: every block any path puts (a record, a
    demotion to disk, a promotion back) begins with the scope of its stage and namespace,
    so the same prompt of two tenants makes two sets of blocks, and what one tenant's
    state deduplicates against never depends on what another sent (tests/test_payload.py
    shows the dedupe itself)."""
    cfg = CacheConfig(admit_after=1, max_bytes=int(entry_bytes * 1.5))
    cold = DirBlockStore(tmp_path, compress=True)
    on = server(qwen3_f32, cfg, cold, policy)
    tags: dict[bytes, set] = {}

    def spied(store, where: str):
        real = store.put

        def recording(data):
            digest = real(data)
            tags.setdefault(bytes(data[:DIGEST_SIZE]), set()).add((where, digest))
            return digest
        store.put = recording

    try:
        spied(on.cache.store, "ram")
        spied(on.cache.tiers.cold.store, "disk")
        for namespace in ("tenant-a", "tenant-b"):
            run(on, A, namespace=namespace)
            run(on, B, namespace=namespace)   # pushes A's entry to disk
            run(on, A2, namespace=namespace)  # and back
        scopes = {on.cache.scope(n).key for n in ("tenant-a", "tenant-b")}
        assert set(tags) == scopes  # no block of no namespace, or of another stage
        a, b = (tags[on.cache.scope(n).key] for n in ("tenant-a", "tenant-b"))
        # RAM holds payloads only under KvRecurrent (ResidentKv keeps lanes there)
        assert {w for w, _ in a} == {w for w, _ in b} == (
            {"disk"} if policy == "ResidentKv" else {"ram", "disk"})
        assert not {d for _, d in a} & {d for _, d in b}
    finally:
        on.loop.stop()
        cold.close()
