"""Exact state payloads: token-page-major layout, bitwise round trip, dedupe, strict manifests."""

import dataclasses
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy.cache.blocks import (BLOCK_SIZE, DIGEST_SIZE, BlockError, BlockStore, CorruptBlock,
                                 MissingBlock, StoreFull)
from skippy.cache.payload import (BLOCK_BODY, FORMAT_VERSION, NO_SCOPE, IncompatiblePayload,
                                  PayloadManifest, PayloadKind, decode_payload, encode_payload,
                                  release_payload)

IDENTITY = bytes(range(32))
SCOPE = bytes(range(100, 132))  # a stage and namespace digest
FIELDS = {"model": "m" * 8, "stage": 0, "layers": [0, 4], "kv_dtype": "f16"}


def random_array(rng, shape, dtype):
    """Random bit patterns (NaNs with payloads, subnormals, -0.0 included): a bitwise check."""
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def kv(rng, n_tokens, layers=4, heads=8, head_dim=64, dtype="<f2"):
    return {f"blk.{layer}.{part}": random_array(rng, (n_tokens, heads, head_dim), dtype)
            for layer in range(layers) for part in "kv"}


def with_suffix_replaced(rng, tensors, keep):
    """The same tensors, rows from `keep` on replaced: a prompt sharing a `keep`-token stem."""
    out = {}
    for name, array in tensors.items():
        other = array.copy()
        other[keep:] = random_array(rng, other[keep:].shape, other.dtype)
        out[name] = other
    return out


def encode_kv(tokens, store, fixed=None, kind=PayloadKind.ResidentKv, scope=NO_SCOPE):
    n_tokens = next(iter(tokens.values())).shape[0]
    return encode_payload(kind, IDENTITY, FIELDS, tokens, fixed or {}, n_tokens, store, scope)


def stored_bytes(m) -> int:
    """A payload's bytes in the store: its own, and the scope each block begins with."""
    return m.total_bytes + DIGEST_SIZE * len(m.blocks)


def assert_bitwise_equal(got, want):
    assert list(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes(), name


def unique_bytes(store, *manifests):
    return sum(len(store.get(h)) for h in {h for m in manifests for h in m.blocks})


def shared_leading_blocks(a, b):
    return next((i for i, (x, y) in enumerate(zip(a.blocks, b.blocks)) if x != y),
                min(len(a.blocks), len(b.blocks)))


# --- round trip ---------------------------------------------------------------------------

DTYPES = ["<f4", "<f2", "<u2", "|i1", "<f8", ">f4", "<c8"]  # <u2 stands in for bf16
row_shapes = st.lists(st.integers(1, 24), min_size=0, max_size=2).map(tuple)
tensor_sets = st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=6),
                              st.tuples(st.sampled_from(DTYPES), row_shapes), max_size=4)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tokens=st.integers(0, 600),
       token_specs=tensor_sets, fixed_specs=tensor_sets,
       scale=st.sampled_from([1, 64, 1024]))
def test_round_trip_is_bitwise_for_any_layout(seed, n_tokens, token_specs, fixed_specs, scale):
    rng = np.random.default_rng(seed)
    # `scale` widens the rows so that a payload spans from part of one page to many pages
    # (or one token to several blocks); the token count is capped to keep each case in ms.
    row_bytes = sum(math.prod(shape) * scale * np.dtype(dt).itemsize for dt, shape in token_specs.values())
    n_tokens = min(n_tokens, 4 * BLOCK_SIZE // max(row_bytes, 1))
    tokens = {n: random_array(rng, (n_tokens, *shape, scale), dt) for n, (dt, shape) in token_specs.items()}
    fixed = {n: random_array(rng, shape, dt) for n, (dt, shape) in fixed_specs.items()}
    store = BlockStore()
    m = encode_payload(PayloadKind.FullState, IDENTITY, FIELDS, tokens, fixed, n_tokens, store)
    got_tokens, got_fixed = decode_payload(m, store)
    assert_bitwise_equal(got_tokens, tokens)
    assert_bitwise_equal(got_fixed, fixed)
    assert PayloadManifest.from_bytes(m.to_bytes()) == m
    release_payload(m, store)
    assert store.stats().physical_bytes == 0


def test_kv_recurrent_round_trip_with_float16_kv_and_float32_state():
    rng = np.random.default_rng(1)
    tokens = kv(rng, 700, layers=2, heads=4, head_dim=96, dtype="<f2")
    fixed = {"blk.0.ssm": random_array(rng, (16, 128, 4), "<f4"),
             "blk.0.conv": random_array(rng, (3, 512), "<f4")}
    store = BlockStore()
    m = encode_kv(tokens, store, fixed, kind=PayloadKind.KvRecurrent)
    got_tokens, got_fixed = decode_payload(m, store)
    assert_bitwise_equal(got_tokens, tokens)
    assert_bitwise_equal(got_fixed, fixed)
    got_tokens["blk.0.k"][0] = 0  # fresh arrays the caller may write into
    assert got_fixed["blk.0.ssm"].flags.writeable


# --- layout -------------------------------------------------------------------------------

def test_a_page_is_one_block_of_all_tensors_rows_in_name_order():
    rng = np.random.default_rng(2)
    tokens = kv(rng, 300, layers=2, heads=8, head_dim=64)     # 4 x 1 KiB per token
    store = BlockStore()
    m = encode_kv(tokens, store, scope=SCOPE)
    assert (m.page_tokens, m.page_stride) == (255, BLOCK_BODY)  # the body after the scope
    first_page = b"".join(tokens[name][:255].tobytes() for name in sorted(tokens))
    assert store.get(m.blocks[0]) == SCOPE + first_page + bytes(BLOCK_BODY - 255 * 4096)
    last_page = b"".join(tokens[name][255:].tobytes() for name in sorted(tokens))
    assert store.get(m.blocks[1]) == SCOPE + last_page
    assert m.total_bytes == BLOCK_BODY + 45 * 4096


def test_rows_that_do_not_divide_a_block_pad_each_page_to_one():
    rng = np.random.default_rng(3)
    tokens = kv(rng, 1000, layers=2, heads=3, head_dim=80, dtype="<f4")   # 3840 B per token
    fixed = {"state": random_array(rng, (100,), "<f4")}
    store = BlockStore()
    m = encode_kv(tokens, store, fixed, kind=PayloadKind.KvRecurrent)
    assert m.page_tokens == BLOCK_BODY // 3840 == 273
    assert m.total_bytes == 3 * BLOCK_BODY + (1000 - 3 * 273) * 3840 + 400
    assert all(len(store.get(h)) == BLOCK_SIZE for h in m.blocks[:-1])
    assert store.get(m.blocks[0]).endswith(bytes(BLOCK_BODY - 273 * 3840))  # zero padding


# --- dedupe -------------------------------------------------------------------------------

def test_payloads_sharing_a_token_stem_store_its_blocks_once():
    rng = np.random.default_rng(4)
    a_tokens = kv(rng, 3200, layers=2, heads=8, head_dim=64)  # 4 KiB per token, 12.5 MiB
    b_tokens = with_suffix_replaced(rng, a_tokens, keep=3000)
    store = BlockStore()
    a, b = encode_kv(a_tokens, store), encode_kv(b_tokens, store)
    assert a.page_tokens == 255
    assert shared_leading_blocks(a, b) == 3000 // 255 == 11
    s = store.stats()
    assert s.physical_bytes == unique_bytes(store, a, b)
    assert s.logical_bytes == stored_bytes(a) + stored_bytes(b)
    assert s.saved_bytes == s.logical_bytes - s.physical_bytes == 11 * BLOCK_SIZE


@pytest.mark.parametrize("head_dim", [64, 80])  # row bytes a power of two, and not
def test_four_layer_kv_sharing_ninety_percent_of_tokens(head_dim):
    rng = np.random.default_rng(5)
    a_tokens = kv(rng, 2000, layers=4, heads=8, head_dim=head_dim)
    b_tokens = with_suffix_replaced(rng, a_tokens, keep=1800)
    store = BlockStore()
    a, b = encode_kv(a_tokens, store), encode_kv(b_tokens, store)
    shared = 1800 // a.page_tokens
    assert shared_leading_blocks(a, b) == shared
    s = store.stats()
    assert s.physical_bytes == unique_bytes(store, a, b)
    assert s.saved_bytes == shared * BLOCK_SIZE
    assert s.physical_bytes < 0.6 * s.logical_bytes


def test_rows_larger_than_a_block_share_every_block_inside_the_common_bytes():
    rng = np.random.default_rng(6)
    a_tokens = {"wide": random_array(rng, (6, 300_000), "<f4")}   # 1.2 MB per token
    b_tokens = with_suffix_replaced(rng, a_tokens, keep=4)
    store = BlockStore()
    a, b = encode_kv(a_tokens, store), encode_kv(b_tokens, store)
    assert (a.page_tokens, a.page_stride, a.total_bytes) == (1, 1_200_000, 7_200_000)
    assert shared_leading_blocks(a, b) == 4 * 1_200_000 // BLOCK_BODY
    assert_bitwise_equal(decode_payload(b, store)[0], b_tokens)


# --- refcounts ----------------------------------------------------------------------------

def test_the_same_state_in_two_scopes_shares_no_block():
    """A scope is a stage and a cache namespace (a tenant): the same prompt's state sent
    by two tenants makes no block of one the other's, so nothing the store deduplicates
    tells one tenant what the other sent."""
    rng = np.random.default_rng(9)
    tokens = kv(rng, 600, layers=2)
    store = BlockStore()
    a = encode_kv(tokens, store, scope=SCOPE)
    b = encode_kv(tokens, store, scope=bytes([7]) * DIGEST_SIZE)
    assert not set(a.blocks) & set(b.blocks)
    s = store.stats()
    assert s.saved_bytes == 0 and s.dedup_puts == 0
    assert_bitwise_equal(decode_payload(b, store)[0], tokens)
    again = encode_kv(tokens, store, scope=SCOPE)  # one scope dedupes as before
    assert again.blocks == a.blocks and store.stats().saved_bytes == stored_bytes(a)
    with pytest.raises(IncompatiblePayload, match="another scope"):  # a manifest that lies
        decode_payload(dataclasses.replace(b, scope=SCOPE), store)


def test_releasing_one_of_two_sharing_payloads_keeps_the_shared_blocks():
    rng = np.random.default_rng(7)
    a_tokens = kv(rng, 1500, layers=2)
    b_tokens = with_suffix_replaced(rng, a_tokens, keep=1200)
    store = BlockStore()
    a, b = encode_kv(a_tokens, store), encode_kv(b_tokens, store)
    release_payload(a, store)
    assert all(store.has(h) for h in b.blocks)
    assert not any(store.has(h) for h in set(a.blocks) - set(b.blocks))
    assert store.stats().physical_bytes == unique_bytes(store, b)
    assert_bitwise_equal(decode_payload(b, store)[0], b_tokens)
    release_payload(b, store)
    s = store.stats()
    assert (s.blocks, s.physical_bytes, s.logical_bytes) == (0, 0, 0)


def test_the_same_state_exported_twice_costs_its_bytes_once():
    rng = np.random.default_rng(8)
    tokens = kv(rng, 800, layers=2)
    store = BlockStore()
    a, b = encode_kv(tokens, store), encode_kv(tokens, store)
    assert a.blocks == b.blocks
    assert store.stats().saved_bytes == stored_bytes(a)
    release_payload(a, store)
    assert_bitwise_equal(decode_payload(b, store)[0], tokens)


# --- failures are misses ------------------------------------------------------------------

def restore_or_recompute(manifest, store, recompute):
    """What a stage does (DESIGN.md §5.2): any bad block means a miss, never a failure."""
    try:
        return decode_payload(manifest, store)[0], "hit"
    except (BlockError, IncompatiblePayload):
        return recompute(), "miss"


def test_a_flipped_byte_in_a_stored_block_is_caught_and_served_as_a_miss():
    rng = np.random.default_rng(9)
    tokens = kv(rng, 1000, layers=2)
    store = BlockStore()
    m = encode_kv(tokens, store)
    store._corrupt_for_test(m.blocks[2], offset=12345)
    with pytest.raises(CorruptBlock):
        decode_payload(m, store)
    assert store.stats().corrupt_reads == 1
    got, how = restore_or_recompute(m, store, recompute=lambda: tokens)
    assert how == "miss" and got is tokens
    assert store.stats().misses == 1  # dropped on detection: the next read is a plain miss
    release_payload(m, store)  # references on the dropped block still release cleanly
    assert store.stats().physical_bytes == 0


def test_a_released_payload_reads_as_missing_blocks():
    rng = np.random.default_rng(10)
    store = BlockStore()
    m = encode_kv(kv(rng, 100, layers=1), store)
    release_payload(m, store)
    with pytest.raises(MissingBlock):
        decode_payload(m, store)


def test_a_payload_refused_by_the_cap_leaves_the_store_as_it_was():
    rng = np.random.default_rng(11)
    a_tokens = kv(rng, 1024, layers=2)               # 4 MiB
    b_tokens = with_suffix_replaced(rng, a_tokens, keep=512)
    store = BlockStore(max_bytes=5 * BLOCK_SIZE)
    a = encode_kv(a_tokens, store)
    before = store.stats()
    with pytest.raises(StoreFull):
        encode_kv(b_tokens, store)                   # shares 2 blocks, needs 2 new; 1 fits
    after = store.stats()
    assert (after.blocks, after.physical_bytes, after.logical_bytes) == (
        before.blocks, before.physical_bytes, before.logical_bytes)
    assert all(store.refs(h) == 1 for h in a.blocks)
    assert_bitwise_equal(decode_payload(a, store)[0], a_tokens)


# --- manifests ----------------------------------------------------------------------------

def small_manifest():
    rng = np.random.default_rng(12)
    fixed = {"ssm": random_array(rng, (4, 8), "<f4")}
    fields = {"model": b"\x01" * 32, "tokens": (1, 2, 3), "rope": {"base": 10000.0}}
    return encode_payload(PayloadKind.KvRecurrent, IDENTITY, fields, kv(rng, 40, layers=2),
                          fixed, 40, BlockStore())


def test_manifest_round_trips_through_msgpack():
    m = small_manifest()
    back = PayloadManifest.from_bytes(m.to_bytes())
    assert back == m and back.format_version == FORMAT_VERSION
    assert back.kind is PayloadKind.KvRecurrent
    assert back.identity_fields["tokens"] == [1, 2, 3]


def tampered(m, **changes):
    doc = msgpack.unpackb(m.to_bytes(), raw=False)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value(doc[key]) if callable(value) else value
    return msgpack.packb(doc, use_bin_type=True)


def set_item(index, value):
    def change(specs):
        specs[0][index] = value
        return specs
    return change


@pytest.mark.parametrize("changes", [
    {"v": FORMAT_VERSION + 1},
    {"v": ...},
    {"kind": "KvOnly"},
    {"kind": 1},
    {"extra": 1},
    {"blocks": ...},
    {"n_tokens": "40"},
    {"n_tokens": True},
    {"n_tokens": -1},
    {"n_tokens": 41},
    {"identity": b"short"},
    {"identity_fields": [1, 2]},
    {"blocks": lambda hs: hs[:-1]},
    {"blocks": lambda hs: [h[:16] for h in hs]},
    {"page_tokens": lambda p: p + 1},
    {"page_stride": 4096},
    {"total_bytes": lambda t: t - 1},
    {"token_tensors": set_item(1, "O")},
    {"token_tensors": set_item(1, "float16")},   # not numpy's canonical string
    {"token_tensors": set_item(1, "not a dtype")},
    {"token_tensors": set_item(2, [8, "64"])},
    {"token_tensors": set_item(3, 7)},
    {"token_tensors": set_item(0, "zzz")},       # names out of order
    {"token_tensors": lambda specs: specs[:1] * 2},
    {"fixed_tensors": []},                       # KvRecurrent without its recurrent state
    {"kind": "ResidentKv"},                      # ResidentKv with fixed state
])
def test_manifest_parse_rejects_anything_but_a_consistent_manifest(changes):
    with pytest.raises(IncompatiblePayload):
        PayloadManifest.from_bytes(tampered(small_manifest(), **changes))


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2]),
                                 msgpack.packb({1: 2}), small_manifest().to_bytes()[:-3]])
def test_manifest_parse_rejects_bytes_that_are_not_a_manifest(raw):
    with pytest.raises(IncompatiblePayload):
        PayloadManifest.from_bytes(raw)


# --- encode arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("kind, tokens, fixed, n_tokens, identity", [
    (PayloadKind.ResidentKv, {"k": np.zeros((5, 2), "<f4")}, {}, 6, IDENTITY),          # rows != n_tokens
    (PayloadKind.ResidentKv, {"k": np.zeros(5, "<f4")}, {"s": np.zeros(3)}, 5, IDENTITY),  # fixed in KV-only
    (PayloadKind.KvRecurrent, {"k": np.zeros((5, 2), "<f4")}, {}, 5, IDENTITY),         # KV without state
    (PayloadKind.RecurrentOnly, {"k": np.zeros((5, 2), "<f4")}, {"s": np.zeros(3)}, 5, IDENTITY),
    (PayloadKind.FullState, {"k": np.zeros((5, 2), object)}, {}, 5, IDENTITY),
    (PayloadKind.FullState, {"k": np.zeros((5, 2), "<f4")}, {}, 5, b"\x00" * 16),
    ("Bogus", {}, {}, 0, IDENTITY),
])
def test_encode_rejects_state_that_does_not_fit_its_kind(kind, tokens, fixed, n_tokens, identity):
    with pytest.raises(ValueError):
        encode_payload(kind, identity, {}, tokens, fixed, n_tokens, BlockStore())


def test_recurrent_only_payload_keeps_its_token_count_without_token_bytes():
    rng = np.random.default_rng(13)
    fixed = {"ssm": random_array(rng, (2, 16), "<f4")}
    store = BlockStore()
    m = encode_payload(PayloadKind.RecurrentOnly, IDENTITY, FIELDS, {}, fixed, 512, store)
    assert (m.n_tokens, m.page_tokens, m.total_bytes) == (512, 0, 128)
    assert PayloadManifest.from_bytes(m.to_bytes()) == m
    assert_bitwise_equal(decode_payload(m, store)[1], fixed)
