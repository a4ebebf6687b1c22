"""Exact prefix identity: canonical, complete, and free of per-process values."""

import os
import subprocess
import sys

import pytest

from skippy.cache.identity import (PrefixIdentity, StageKey, block_chain, canonical, page_id,
                                   prefix_digest, prefix_digests)


def key(**changes) -> StageKey:
    base = dict(model_digest="m" * 64, topology_digest="t" * 64, stage_index=1, layer_start=10,
                layer_end=20, runtime_abi="skippy-torch/1", kv_layout="token-major",
                kv_dtype="f32", wire_dtype="f16", n_ctx=8192, rope=(1e5, None, 1.0, 64),
                numeric_policy=(("chunk", 64), ("compute", "f32"), ("threads", 2)))
    return StageKey(**{**base, **changes})


@pytest.mark.parametrize("field, value", [
    ("model_digest", "x" * 64), ("topology_digest", "y" * 64), ("stage_index", 2),
    ("layer_start", 11), ("layer_end", 21), ("runtime_abi", "skippy-torch/2"),
    ("kv_layout", "layer-major"), ("kv_dtype", "f16"), ("wire_dtype", "f32"), ("n_ctx", 4096),
    ("rope", (1e6, None, 1.0, 64)), ("numeric_policy", (("chunk", 32),)), ("namespace", "tenant-a"),
])
def test_every_field_changes_the_digest(field, value):
    assert key(**{field: value}).digest != key().digest


def test_token_start_and_every_token_matter():
    k = key()
    base = prefix_digest(k, [1, 2, 3])
    assert prefix_digest(k, [1, 2, 3], token_start=64) != base
    assert prefix_digest(k, [1, 2, 4]) != base
    assert prefix_digest(k, [1, 2]) != base
    assert PrefixIdentity(k, (1, 2, 3)).digest == base
    assert len(PrefixIdentity(k, (1, 2, 3)).page_id) == 16


def test_digest_is_the_same_in_another_process():
    """Nothing per-process (hash seeds, ids, times) may enter an identity."""
    code = ("from tests.test_identity import key;"
            "from skippy.cache.identity import prefix_digest;"
            "print(prefix_digest(key(), [5, 6, 7]).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"},
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    assert out.stdout.strip() == prefix_digest(key(), [5, 6, 7]).hex()


def test_canonical_encoding_ignores_dict_order_but_not_values():
    assert canonical({"a": 1, "b": [1, 2]}) == canonical({"b": (1, 2), "a": 1})
    assert canonical({"a": 1}) != canonical({"a": 1.0})  # int and float are different values
    assert canonical({"a": 1}) != canonical({"a": 2})
    with pytest.raises(TypeError):
        canonical({"a": object()})


def test_prefix_digests_match_one_at_a_time():
    k, tokens = key(), list(range(300))
    many = prefix_digests(k, tokens, [64, 128, 256])
    assert many == {n: prefix_digest(k, tokens[:n]) for n in (64, 128, 256)}


def test_block_chain_is_parent_chained():
    k = key()
    a = block_chain(k, list(range(256)), 64)
    b = block_chain(k, list(range(128)) + [0] * 128, 64)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    c = block_chain(key(stage_index=3), list(range(256)), 64)
    assert not set(a) & set(c)
    assert page_id(a[0]) == a[0].hex()[:16]
