"""Exact state payloads: a stage's exported state as a msgpack manifest over store blocks.

The state arrives as named numpy arrays (torch stays out of `cache/`): token tensors, each
shaped [n_tokens, *row] (per-layer K and V), and fixed tensors of any shape with no token
axis (recurrent/SSM/conv state).

Byte layout, token-page-major (DESIGN.md §5.4). Tensors go in name order. Tokens are cut
into pages of `page_tokens`; a page holds, for each token tensor in turn, that tensor's
rows for the page's tokens. The fixed tensors follow the last page, and the whole is cut
into blocks of BLOCK_BODY bytes, each stored as a BLOCK_SIZE block behind the payload's
scope.

Every block begins with the payload's scope: the digest of its stage and cache namespace
(DESIGN.md §5.1), so the same state in two namespaces never makes the same block. A
tenant cannot learn that another sent the same prompt from what the store deduplicates
(a figure, or a put that is faster for having nothing to write), while the payloads of one
namespace share blocks as below. The rules below speak of a block's body.

- When one token's rows (all tensors) fit a block, a page is the most tokens that fit one
  block and every full page is zero-padded to exactly one block. Page j is then block j:
  two payloads of the same layout whose first m tokens agree share their first
  m // page_tokens blocks, whatever the row size (any row wastes less than one row per
  block). Without the padding the
  pages would drift across block boundaries and the block straddling the end of the common
  pages would differ; with a power-of-two page count instead of the most that fit, an
  awkward row size would pad up to half of every block.
- When one token's rows exceed a block, a page is one token and is not padded: padding
  would waste up to a block per token, while every block lying wholly inside the common
  bytes is still shared, so at most one block at the end of the common part differs.

The last page may be short and is not padded, and the fixed state is not aligned: both
differ between payloads of different prompts anyway, and padding them would cost up to a
block per payload.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import msgpack
import numpy as np

from skippy.cache.blocks import BLOCK_SIZE, DIGEST_SIZE, BlockStore

FORMAT_VERSION = 2  # 2: blocks begin with the payload's scope
BLOCK_BODY = BLOCK_SIZE - DIGEST_SIZE  # a block's payload bytes, after the scope
NO_SCOPE = bytes(DIGEST_SIZE)  # payloads of no stage (tests, certify's round trip)

# Plain numeric dtypes only: their bytes are their value, so a round trip is bitwise.
_DTYPE_KINDS = "biufc"


class PayloadKind(str, Enum):
    ResidentKv = "ResidentKv"          # dense attention KV; exported only when moved
    KvRecurrent = "KvRecurrent"        # attention KV together with recurrent/SSM state
    FullState = "FullState"            # whole sequence state; diagnostic only
    RecurrentOnly = "RecurrentOnly"    # recurrent state alone; diagnostic only


class IncompatiblePayload(Exception):
    """A manifest this build cannot use (version, kind, malformed or inconsistent layout);
    the caller treats it as a miss and recomputes."""


@dataclass(frozen=True)
class PayloadTensor:
    """One tensor's place in the payload.

    Token tensors: `shape` is one token's row shape, `nbytes` one row's bytes, and
    `offset` the bytes of the tensors before it in one token's rows (inside a page of r
    tokens, this tensor starts at page start + r * offset). Fixed tensors: `shape` is the
    full shape, and `offset`/`nbytes` locate it in the payload.
    """

    name: str
    dtype: str     # numpy dtype string, e.g. "<f2"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PayloadManifest:
    """What a payload holds and which blocks, in order, hold its bytes."""

    kind: PayloadKind
    identity: bytes                                   # prefix identity digest (§5.1)
    identity_fields: Mapping[str, Any] = field(hash=False)
    n_tokens: int
    token_tensors: tuple[PayloadTensor, ...]
    fixed_tensors: tuple[PayloadTensor, ...]
    page_tokens: int      # tokens per page; 0 when there are no token bytes
    page_stride: int      # bytes a full page occupies, padding included
    total_bytes: int
    blocks: tuple[bytes, ...]
    scope: bytes = NO_SCOPE  # the stage and namespace digest each block begins with
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "v": self.format_version,
            "kind": self.kind.value,
            "identity": self.identity,
            "identity_fields": dict(self.identity_fields),
            "n_tokens": self.n_tokens,
            "token_tensors": [_spec_to_list(s) for s in self.token_tensors],
            "fixed_tensors": [_spec_to_list(s) for s in self.fixed_tensors],
            "page_tokens": self.page_tokens,
            "page_stride": self.page_stride,
            "total_bytes": self.total_bytes,
            "blocks": list(self.blocks),
            "scope": self.scope,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PayloadManifest:
        """Strict parse: anything but a well-formed, self-consistent manifest of this format
        version raises `IncompatiblePayload`."""
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise IncompatiblePayload(f"manifest is not msgpack: {e}") from None
        if not isinstance(doc, dict):
            raise IncompatiblePayload("manifest is not a map")
        if doc.get("v") != FORMAT_VERSION:
            raise IncompatiblePayload(f"manifest format {doc.get('v')!r}, expected {FORMAT_VERSION}")
        expected = {"v", "kind", "identity", "identity_fields", "n_tokens", "token_tensors",
                    "fixed_tensors", "page_tokens", "page_stride", "total_bytes", "blocks",
                    "scope"}
        if set(doc) != expected:
            raise IncompatiblePayload(f"manifest keys differ: {sorted(set(doc) ^ expected)}")
        try:
            kind = PayloadKind(doc["kind"])
        except ValueError:
            raise IncompatiblePayload(f"unknown payload kind {doc['kind']!r}") from None
        identity = _expect_digest(doc["identity"], "identity")
        if not isinstance(doc["identity_fields"], dict):
            raise IncompatiblePayload("identity_fields is not a map")
        manifest = cls(
            kind=kind,
            identity=identity,
            identity_fields=doc["identity_fields"],
            n_tokens=_expect_count(doc["n_tokens"], "n_tokens"),
            token_tensors=_parse_specs(doc["token_tensors"], "token_tensors"),
            fixed_tensors=_parse_specs(doc["fixed_tensors"], "fixed_tensors"),
            page_tokens=_expect_count(doc["page_tokens"], "page_tokens"),
            page_stride=_expect_count(doc["page_stride"], "page_stride"),
            total_bytes=_expect_count(doc["total_bytes"], "total_bytes"),
            blocks=tuple(_expect_digest(h, "block hash") for h in _expect_list(doc["blocks"], "blocks")),
            scope=_expect_digest(doc["scope"], "scope"),
        )
        _check_kind(kind, manifest.token_tensors, manifest.fixed_tensors, IncompatiblePayload)
        # The layout must be exactly the one this build would write for these tensors.
        try:
            layout = _layout([(s.name, s.dtype, s.shape) for s in manifest.token_tensors],
                             [(s.name, s.dtype, s.shape) for s in manifest.fixed_tensors],
                             manifest.n_tokens)
        except ValueError as e:
            raise IncompatiblePayload(str(e)) from None
        if layout != (manifest.token_tensors, manifest.fixed_tensors, manifest.page_tokens,
                      manifest.page_stride, manifest.total_bytes):
            raise IncompatiblePayload("manifest layout is inconsistent")
        if len(manifest.blocks) != math.ceil(manifest.total_bytes / BLOCK_BODY):
            raise IncompatiblePayload("manifest block count does not match its size")
        return manifest


def encode_payload(kind: PayloadKind, identity: bytes, identity_fields: Mapping[str, Any],
                   token_tensors: Mapping[str, np.ndarray], fixed_tensors: Mapping[str, np.ndarray],
                   n_tokens: int, store: BlockStore, scope: bytes = NO_SCOPE) -> PayloadManifest:
    """Lay the state out token-page-major, put its blocks in `store` (each beginning with
    `scope`, the digest of the stage and namespace it belongs to), return the manifest.

    Each block put adds one reference, owned by the returned manifest until
    `release_payload`. If the store refuses a block (`StoreFull`), the blocks already put
    are released again and the error propagates: nothing is left behind.
    """
    kind = PayloadKind(kind)
    identity = bytes(identity)
    n_tokens = operator.index(n_tokens)  # a numpy integer would not pack into the manifest
    if len(identity) != DIGEST_SIZE or len(scope) != DIGEST_SIZE:
        raise ValueError(f"identity and scope must be {DIGEST_SIZE}-byte digests, got "
                         f"{len(identity)} and {len(scope)} bytes")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    # Normalised through msgpack (tuples become lists, ...), so that the manifest equals
    # its own round trip; this also rejects fields msgpack cannot carry.
    fields = msgpack.unpackb(msgpack.packb(dict(identity_fields), use_bin_type=True),
                             raw=False, strict_map_key=True)
    tokens = {name: np.asarray(token_tensors[name]) for name in sorted(token_tensors)}
    fixed = {name: np.asarray(fixed_tensors[name]) for name in sorted(fixed_tensors)}
    for name, array in tokens.items():
        if array.ndim == 0 or array.shape[0] != n_tokens:
            raise ValueError(f"token tensor '{name}' has shape {array.shape}, expected [{n_tokens}, ...]")
    _check_kind(kind, tokens, fixed, ValueError)
    token_specs, fixed_specs, page_tokens, page_stride, total = _layout(
        [(n, a.dtype.str, a.shape[1:]) for n, a in tokens.items()],
        [(n, a.dtype.str, a.shape) for n, a in fixed.items()], n_tokens)

    buf = bytearray(total)  # zero-filled, which is the page padding
    for start, rows, page_off in _pages(n_tokens, page_tokens, page_stride):
        for spec, array in zip(token_specs, tokens.values()):
            at = page_off + rows * spec.offset
            buf[at:at + rows * spec.nbytes] = array[start:start + rows].tobytes()
    for spec, array in zip(fixed_specs, fixed.values()):
        buf[spec.offset:spec.offset + spec.nbytes] = array.tobytes()

    view, hashes = memoryview(buf), []
    try:
        for at in range(0, total, BLOCK_BODY):
            hashes.append(store.put(scope + view[at:at + BLOCK_BODY]))
    except BaseException:
        for h in hashes:
            store.release(h)
        raise
    return PayloadManifest(kind, identity, fields, n_tokens, token_specs, fixed_specs,
                    page_tokens, page_stride, total, tuple(hashes), bytes(scope))


def decode_payload(manifest: PayloadManifest, store: BlockStore) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Read every block (each verified by the store) and rebuild the arrays bitwise.

    Returns (token_tensors, fixed_tensors), fresh writable arrays keyed by name. Raises
    `MissingBlock` / `CorruptBlock` (from the store) or `IncompatiblePayload` if the blocks
    do not add up to the manifest's size; a caller treats each as a miss and recomputes.
    """
    buf, at = bytearray(manifest.total_bytes), 0
    for h in manifest.blocks:
        block = store.get(h)
        if block[:DIGEST_SIZE] != manifest.scope:
            raise IncompatiblePayload("a payload block of another scope")
        block = memoryview(block)[DIGEST_SIZE:]
        if at + len(block) > manifest.total_bytes:
            raise IncompatiblePayload("payload blocks exceed the manifest's size")
        buf[at:at + len(block)] = block
        at += len(block)
    if at != manifest.total_bytes:
        raise IncompatiblePayload("payload blocks fall short of the manifest's size")

    tokens = {s.name: np.empty((manifest.n_tokens, *s.shape), dtype=s.dtype) for s in manifest.token_tensors}
    for start, rows, page_off in _pages(manifest.n_tokens, manifest.page_tokens, manifest.page_stride):
        for spec in manifest.token_tensors:
            if not spec.nbytes:
                continue
            out = tokens[spec.name]
            at = page_off + rows * spec.offset
            out[start:start + rows] = np.frombuffer(
                buf, dtype=out.dtype, count=rows * spec.nbytes // out.itemsize, offset=at,
            ).reshape((rows, *spec.shape))
    fixed = {}
    for spec in manifest.fixed_tensors:
        part = buf[spec.offset:spec.offset + spec.nbytes]  # a copy: the array owns its bytes
        fixed[spec.name] = np.frombuffer(part, dtype=spec.dtype).reshape(spec.shape)
    return tokens, fixed


def release_payload(manifest: PayloadManifest, store: BlockStore) -> None:
    """Drop the manifest's reference on each of its blocks; a block is freed when the last
    payload using it goes. Releases every block even if one fails, then re-raises."""
    error = None
    for h in manifest.blocks:
        try:
            store.release(h)
        except Exception as e:  # keep releasing: one bad hash must not leak the rest
            error = error or e
    if error is not None:
        raise error


def _layout(token_rows: list[tuple[str, str, tuple[int, ...]]],
            fixed: list[tuple[str, str, tuple[int, ...]]], n_tokens: int):
    """(token specs, fixed specs, page_tokens, page_stride, total bytes) for tensors given
    as (name, dtype string, row or full shape), in name order."""
    token_specs, row_bytes = [], 0
    for name, dtype, shape in token_rows:
        nbytes = _nbytes(name, dtype, shape)
        token_specs.append(PayloadTensor(name, dtype, tuple(shape), row_bytes, nbytes))
        row_bytes += nbytes
    if row_bytes == 0:
        page_tokens, page_stride = 0, 0
    elif row_bytes <= BLOCK_BODY:
        page_tokens, page_stride = BLOCK_BODY // row_bytes, BLOCK_BODY
    else:
        page_tokens, page_stride = 1, row_bytes
    total = 0
    if page_tokens:
        full, rest = divmod(n_tokens, page_tokens)
        total = full * page_stride + rest * row_bytes
    fixed_specs = []
    for name, dtype, shape in fixed:
        nbytes = _nbytes(name, dtype, shape)
        fixed_specs.append(PayloadTensor(name, dtype, tuple(shape), total, nbytes))
        total += nbytes
    return tuple(token_specs), tuple(fixed_specs), page_tokens, page_stride, total


def _pages(n_tokens: int, page_tokens: int, page_stride: int):
    """(first token, tokens in page, byte offset) for each page."""
    if page_tokens == 0:
        return
    for page, start in enumerate(range(0, n_tokens, page_tokens)):
        yield start, min(page_tokens, n_tokens - start), page * page_stride


def _nbytes(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt.kind not in _DTYPE_KINDS or dt.str != dtype:
        raise ValueError(f"tensor '{name}': unsupported dtype {dtype!r}")
    return math.prod(shape) * dt.itemsize


def _check_kind(kind: PayloadKind, tokens, fixed, error: type[Exception]) -> None:
    # ResidentKv is attention KV only: token rows, or a runtime's own opaque KV bytes
    # (llama.cpp's sequence state of a dense model), never both.
    if kind is PayloadKind.ResidentKv and fixed and tokens:
        raise error("a ResidentKv payload holds KV rows or one opaque KV state, not both")
    if kind is PayloadKind.RecurrentOnly and tokens:
        raise error("a RecurrentOnly payload holds no token rows")
    if kind is PayloadKind.KvRecurrent and not fixed:
        # KV alone is not the continuation state of a recurrent family (DESIGN.md §2).
        raise error("a KvRecurrent payload needs its recurrent state")


def _spec_to_list(spec: PayloadTensor) -> list:
    return [spec.name, spec.dtype, list(spec.shape), spec.offset, spec.nbytes]


def _parse_specs(value: Any, what: str) -> tuple[PayloadTensor, ...]:
    specs = []
    for item in _expect_list(value, what):
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[0], str)
                and isinstance(item[1], str)):
            raise IncompatiblePayload(f"{what}: malformed entry {item!r}")
        shape = tuple(_expect_count(d, f"{what} shape") for d in _expect_list(item[2], f"{what} shape"))
        specs.append(PayloadTensor(item[0], item[1], shape, _expect_count(item[3], what),
                                _expect_count(item[4], what)))
    names = [s.name for s in specs]
    if names != sorted(set(names)):
        raise IncompatiblePayload(f"{what}: names not unique and in order")
    return tuple(specs)


def _expect_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise IncompatiblePayload(f"{what} is not a list")
    return value


def _expect_count(value: Any, what: str) -> int:
    # bool is an int in Python; a manifest that says `true` for a size is malformed.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IncompatiblePayload(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _expect_digest(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        raise IncompatiblePayload(f"{what} must be a {DIGEST_SIZE}-byte digest")
    return value
