"""A lazy GGUF reader: metadata and tensor index without the tokenizer's cost.

gguf-py's `GGUFReader` builds a Python object per element of every array, which takes
seconds on the tokenizer arrays of the shipped models (evals/README.md, GGUF reading). A stage that never tokenizes only
needs the scalar metadata and the tensor index, so arrays are recorded here as
(type, count, offset) and decoded only when someone asks for them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UserError

GGUF_MAGIC = b"GGUF"

# GGUF value types -> (struct format, size); 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Numeric arrays up to this many elements are decoded eagerly (per-layer head counts,
# rope sections); longer ones (tokenizer scores, token types) stay lazy.
_EAGER_ARRAY_MAX = 4096


class GGUFError(UserError):
    """The file is not a GGUF we can read (bad magic, truncated, unknown type)."""


class ModelConfigError(GGUFError):
    """The GGUF reads, but its metadata describes a model we cannot build (a key missing,
    counts that disagree, a feature this family does not support)."""


@dataclass(frozen=True)
class LazyArray:
    """An array value left undecoded: element type, count and where its elements start."""

    elem_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # ggml order: shape[0] is the contiguous (input) dimension
    qtype: GGMLQuantizationType
    offset: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """Metadata and tensor index of one GGUF file; tensor bytes are memory-mapped on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFError(f"{self.path}: cannot open ({e})") from e
        self._load(mm, len(mm))

    @classmethod
    def from_header(cls, path: str | Path, head: bytes, size: int) -> GGUFFile:
        """Metadata and tensor index parsed from the leading bytes of a `size`-byte file that
        the caller already holds (a package part read once and hashed): nothing is read from
        `path`, which only names the file in messages, and `raw` has no tensor bytes."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self._load(np.frombuffer(head, dtype=np.uint8), size)
        return self

    def _load(self, mm: np.ndarray, size: int) -> None:
        self._mm = mm
        self._size = size
        self._buf = memoryview(self._mm)
        self.metadata: dict[str, object] = {}
        # Where each key-value entry's bytes lie, [start, end): a package part copies
        # entries verbatim, so every value keeps its exact GGUF type.
        self.kv_spans: dict[str, tuple[int, int]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF ({e})") from e

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported")
        self.version = version
        pos = 24
        for _ in range(n_kv):
            start = pos
            key, pos = self._string(pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            value, pos = self._value(vtype, pos)
            self.metadata[key] = value
            self.kv_spans[key] = (start, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            qtype, rel = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(qtype), rel))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        for name, dims, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) // block * type_size
            start = data_start + rel
            if start + nbytes > self._size:
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = TensorInfo(name, dims, qtype, start, nbytes)
        self.data_start = data_start

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        pos += 8
        return bytes(self._buf[pos:pos + n]).decode("utf-8"), pos + n

    def _value(self, vtype: int, pos: int) -> tuple[object, int]:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + size
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        elem_type, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if elem_type in _NUMPY:
            size = _SCALARS[elem_type][1]
            end = pos + size * count
            if count <= _EAGER_ARRAY_MAX:
                arr = np.frombuffer(self._buf[pos:end], dtype=_NUMPY[elem_type])
                return arr.tolist(), end
            return LazyArray(elem_type, count, pos), end
        if elem_type == _STRING:
            start = pos
            if count <= 64:
                items = []
                for _ in range(count):
                    s, pos = self._string(pos)
                    items.append(s)
                return items, pos
            for _ in range(count):  # skip: only lengths are read
                (n,) = struct.unpack_from("<Q", self._buf, pos)
                pos += 8 + n
            return LazyArray(elem_type, count, start), pos
        raise GGUFError(f"{self.path}: nested metadata arrays are not supported")

    # -- access ----------------------------------------------------------------------------
    def get(self, key: str, default=None):
        """A metadata value; lazy arrays are decoded here, on first request."""
        value = self.metadata.get(key, default)
        if isinstance(value, LazyArray):
            value = self._decode_array(value)
            self.metadata[key] = value
        return value

    def _decode_array(self, arr: LazyArray) -> list:
        if arr.elem_type == _STRING:
            out, pos = [], arr.offset
            for _ in range(arr.count):
                s, pos = self._string(pos)
                out.append(s)
            return out
        size = _SCALARS[arr.elem_type][1]
        raw = self._buf[arr.offset:arr.offset + size * arr.count]
        return np.frombuffer(raw, dtype=_NUMPY[arr.elem_type]).tolist()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_key(self, suffix: str, default=None):
        """`{arch}.{suffix}`, e.g. arch_key("block_count")."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def kv_entry(self, key: str) -> bytes:
        """One metadata entry exactly as stored (key, type, value), for copying."""
        start, end = self.kv_spans[key]
        return bytes(self._buf[start:end])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, memory-mapped (no copy)."""
        info = self.tensors[name]
        if info.offset + info.nbytes > len(self._mm):
            raise GGUFError(f"{self.path}: only the header is held, not {name}'s bytes")
        return self._mm[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        self._buf.release()
        del self._mm
