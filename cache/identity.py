"""Exact prefix identity: everything that decides a stage's state for a token prefix.

A hit is valid only when every field of DESIGN.md §5.1 matches. The fields that do not
depend on the tokens form a `StageKey`; its digest is hashed together with the token
start and the token ids into a `PrefixIdentity`. Encoding is canonical (msgpack with
sorted keys, ints as ints, tokens as little-endian int32) and holds nothing
per-process, so identities match across restarts and nodes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3
import msgpack

DIGEST_BYTES = 32
PAGE_ID_HEX = 16


def canonical(value) -> bytes:
    """Deterministic bytes for nested dicts/lists/tuples of str, int, float, bool, None,
    bytes: dict keys sorted, tuples as lists."""
    return msgpack.packb(_normalize(value), use_bin_type=True)


def _normalize(value):
    if isinstance(value, dict):
        return [[str(k), _normalize(value[k])] for k in sorted(value, key=str)]
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, (str, int, float, bool, bytes)) or value is None:
        return value
    raise TypeError(f"cannot encode {type(value).__name__} in an identity")


TOKEN_BYTES = 4


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32: the one byte form every hash and comparison of
    tokens uses."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


@dataclass(frozen=True)
class StageKey:
    """The token-independent part of an identity (DESIGN.md §5.1)."""

    model_digest: str
    topology_digest: str
    stage_index: int
    layer_start: int
    layer_end: int
    runtime_abi: str
    kv_layout: str
    kv_dtype: str
    wire_dtype: str
    n_ctx: int
    rope: tuple = ()
    numeric_policy: tuple = ()   # sorted (name, value) pairs: dtype, weights, threads, chunk
    namespace: str = ""          # tenant `cache_salt`; "" = shared
    digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self):
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "digest"}
        object.__setattr__(self, "digest", blake3.blake3(canonical(fields)).digest())

    def with_namespace(self, namespace: str) -> "StageKey":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "digest"}
        return StageKey(**{**values, "namespace": namespace})


def prefix_digest(stage: StageKey | bytes, tokens: Sequence[int] | bytes,
                  token_start: int = 0) -> bytes:
    """BLAKE3 of (stage digest, token start, token ids); tokens as ids or token_bytes."""
    h = blake3.blake3(stage.digest if isinstance(stage, StageKey) else stage)
    h.update(token_start.to_bytes(8, "little"))
    h.update(tokens if isinstance(tokens, bytes) else token_bytes(tokens))
    return h.digest()


def prefix_digests(stage: StageKey | bytes, tokens: Sequence[int],
                   lengths: Sequence[int], token_start: int = 0) -> dict[int, bytes]:
    """Digests of several prefixes of one token list in one pass over the tokens."""
    h = blake3.blake3(stage.digest if isinstance(stage, StageKey) else stage)
    h.update(token_start.to_bytes(8, "little"))
    out, done = {}, 0
    for n in sorted(set(lengths)):
        h.update(token_bytes(tokens[done:n]))
        done = n
        out[n] = h.copy().digest()
    return out


def page_id(digest: bytes) -> str:
    """The short printable form of a digest, for logs and cache keys."""
    return digest.hex()[:PAGE_ID_HEX]


@dataclass(frozen=True)
class PrefixIdentity:
    stage: StageKey
    tokens: tuple[int, ...]
    token_start: int = 0

    @property
    def digest(self) -> bytes:
        return prefix_digest(self.stage, self.tokens, self.token_start)

    @property
    def page_id(self) -> str:
        return page_id(self.digest)


def block_chain(stage: StageKey | bytes, tokens: Sequence[int], block: int,
                hash_fn=None) -> list[bytes]:
    """Parent-chained hashes of the full `block`-token runs of `tokens`
    (vLLM-style): hash i covers the stage and tokens [0, (i+1)*block), so equal hashes
    at depth i mean (barring collisions) equal prefixes. The index only ranks candidates
    by these; an exact token comparison always confirms."""
    return block_chain_bytes(stage, token_bytes(tokens), block, hash_fn)


def block_chain_bytes(stage: StageKey | bytes, raw: bytes, block: int,
                      hash_fn=None) -> list[bytes]:
    """block_chain over tokens already in token_bytes form."""
    parent = stage.digest if isinstance(stage, StageKey) else stage
    hash_fn = hash_fn or _chain_hash
    view, step = memoryview(raw), block * TOKEN_BYTES
    out = []
    for i in range(len(raw) // step):
        parent = hash_fn(parent, view[i * step:(i + 1) * step])
        out.append(parent)
    return out


def _chain_hash(parent: bytes, run) -> bytes:
    # 16 bytes are plenty to rank candidates: a collision costs a verification, never a
    # wrong hit.
    h = blake3.blake3(parent)
    h.update(run)
    return h.digest(16)
