"""Load only what a stage owns from a GGUF: its layers, plus embeddings / head at the ends.

Tensors are dequantized straight from the memory-mapped file, one tensor at a time, so a
stage never touches another stage's bytes: the plain and block types most files hold by
torch here, every other GGML type by gguf-py, with the same values to the bit. The digest covers exactly the bytes loaded: it is the
model-digest part of the cache identity, stable across file names and processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import blake3
import numpy as np
import torch
from gguf.quants import dequantize

from gguf import GGMLQuantizationType

from skippy.topology.errors import UserError
from skippy.topology.gguf_file import GGUFFile, ModelConfigError
from skippy.topology.model_config import ModelConfig

from .linear import GROUP, Int4Blocks, Int8Blocks, Matrix, Q6KBlocks


# Llama 3's per-dimension rope frequency factors: one tensor every attention layer reads.
ROPE_FREQS = "rope_freqs.weight"


class MissingTensor(UserError):
    """The GGUF lacks a tensor this stage needs."""


class StageTensors:
    """One stage's tensors, keyed by GGUF name, read from the file when asked for: a
    stage builds each layer from its matrices and drops them, so loading never holds
    the stage's weights as float32 all at once (only the formats the layers keep).
    Values read with [] (norms and other vectors) are kept; matrices are not, so a tied
    model's head reads the embeddings a second time."""

    def __init__(self, f: GGUFFile, names: list[str]):
        self.f, self.names = f, set(names)
        self._kept: dict[str, torch.Tensor] = {}
        self.digest = ""
        self.source_bytes = 0  # bytes read from the file (quantized size)

    def _check(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        """Float32 values, Linear layout (out, in)."""
        self._check(name)
        if name not in self._kept:
            self._kept[name] = dequantize_tensor(self.f, name)
        return self._kept[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self.names else None

    def matrix(self, name: str, q6k: bool = False) -> Matrix:
        """A weight matrix for make_linear, read now and not kept: its values and, if
        stored so, the file's 4-bit (Q4_0 / Q4_1) or 8-bit (Q8_0) blocks, and with `q6k`
        (a head: make_head reads them) its Q6_K blocks."""
        self._check(name)
        values = self._kept.get(name)
        if values is None:
            values = dequantize_tensor(self.f, name)
        return Matrix(values, int4_blocks(self.f, name), int8_blocks(self.f, name),
                      q6k_blocks(self.f, name) if q6k else None)

    def table_rows(self, name: str) -> "QuantizedRows | None":
        """An embedding table's rows as the file stores them, where Embeddings has no
        block form of its own for the type (Q8_0 and Q6_K have one; F32 is its values)."""
        self._check(name)
        info = self.f.tensors[name]
        if len(info.shape) != 2 or info.qtype in _OWN_ROWS:
            return None
        n, k = int(info.shape[1]), int(info.shape[0])
        return QuantizedRows(np.asarray(self.f.raw(name)), info.qtype, n, k)

    def experts(self, name: str) -> Iterator[Matrix]:
        """A 3-D expert tensor (GGUF {in, out, n_expert}) one expert at a time, read now and
        not kept: its values and, if stored so, its own 4-bit or 8-bit blocks, for
        make_linear expert by expert. An expert's bytes are one contiguous slice of the
        stack's, so no more than one expert is ever dequantized at a time."""
        self._check(name)
        info = self.f.tensors[name]
        if len(info.shape) != 3:
            raise ModelConfigError(f"{name}: expected a 3-D expert tensor, not {tuple(info.shape)}")
        k, n, n_expert = (int(d) for d in info.shape)
        raw = np.asarray(self.f.raw(name))
        per = raw.shape[0] // n_expert
        for e in range(n_expert):
            part = raw[e * per:(e + 1) * per]
            yield Matrix(dequantize_raw(part, info.qtype, (n, k)),
                         int4_of(part, info.qtype, (n, k)), int8_of(part, info.qtype, (n, k)))


def owned_tensor_names(f: GGUFFile, cfg: ModelConfig, start: int, end: int,
                       first: bool, last: bool) -> list[str]:
    """Names of the tensors a stage [start, end) loads, in file order."""
    prefixes = tuple(f"blk.{i}." for i in range(start, end))
    names = [n for n in f.tensors if n.startswith(prefixes)]
    if ROPE_FREQS in f.tensors:
        names.append(ROPE_FREQS)
    names += [n for n in cfg.family.stage_tensors if n in f.tensors]
    if first:
        names.append("token_embd.weight")
    if last:
        if cfg.family.output_norm is not None:
            names.append(cfg.family.output_norm)
        names.append("token_embd.weight" if cfg.tied_head else "output.weight")
        names += cfg.nextn_tensors(f.tensors)
    missing = [n for n in names if n not in f.tensors]
    if missing:
        raise MissingTensor(f"{f.path.name}: missing tensor(s) {', '.join(missing[:3])}")
    seen: set[str] = set()
    unique = [n for n in names if not (n in seen or seen.add(n))]
    return sorted(unique, key=lambda n: f.tensors[n].offset)


# types whose tables Embeddings holds in a form of its own (linear.py)
_OWN_ROWS = (GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K)


class QuantizedRows:
    """A table held as the file's bytes (any GGML type), a row dequantized when asked for
    by the function that dequantizes the whole table (each block stands alone: the same
    bits). An embedding table then costs its file size: Q4_0 0.56 bytes a value, not 4 (a
    128k x 4096 Q4_K table 0.3 GB where float32 is 2.1 GB)."""

    def __init__(self, raw: np.ndarray, qtype, n: int, k: int):
        self.data = _bytes(raw).clone().view(n, -1)  # a copy: the file may go away
        self.qtype, self.n, self.k = qtype, n, k

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 values of rows `ids` (any shape), shaped [..., k]."""
        flat = ids.reshape(-1).to(torch.int64)
        if not flat.numel():
            return torch.empty(*ids.shape, self.k)
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= self.n:
            raise IndexError(f"row out of range [0, {self.n})")
        picked = self.data[flat]
        fast = _TORCH_DEQUANT.get(self.qtype)  # as dequantize_raw, without its numpy trip
        values = fast(picked.reshape(-1)) if fast is not None else \
            dequantize_raw(picked.numpy(), self.qtype, (flat.numel(), self.k))
        return values.reshape(*ids.shape, self.k)


def dequantize_tensor(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors[name]
    return dequantize_raw(np.asarray(f.raw(name)), info.qtype,
                          tuple(int(d) for d in reversed(info.shape)))


def dequantize_raw(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a tensor's bytes `raw` (GGML type `qtype`), shaped `shape`
    (torch order: inputs last)."""
    fast = _TORCH_DEQUANT.get(qtype)
    if fast is not None:
        return fast(_bytes(raw)).reshape(shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    values = dequantize(raw.reshape(rows, -1), qtype).astype(np.float32, copy=False)
    return torch.from_numpy(values.reshape(shape).copy())


# The types most files hold, dequantized by torch in a few whole-tensor ops: gguf-py's numpy
# takes 1.8 s for Gemma 3's 262k-row Q8_0 embedding, which every first and last stage reads.
# Each computes what gguf-py (and ggml) computes, in the same float32 operations: a scale
# times a code, plus the offset after rounding the product (Q4_1), so the bits are the same.
def _bytes(raw: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over a tensor's bytes, not copied: they are the read-only mapped file,
    and whatever reads them here writes a new tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))


def _f16_scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16_scale(blocks, 0))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Block codes in element order: byte j holds element j (low) and j + 16 (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)
    codes = _nibbles(blocks[:, 2:]).to(torch.int8).sub_(8)
    return codes.float().mul_(_f16_scale(blocks, 0))


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)
    codes = _nibbles(blocks[:, 4:]).float()
    return codes.mul_(_f16_scale(blocks, 0)).add_(_f16_scale(blocks, 2))


_TORCH_DEQUANT = {
    GGMLQuantizationType.F32: lambda raw: raw.view(torch.float32).clone(),
    GGMLQuantizationType.F16: lambda raw: raw.view(torch.float16).float(),
    GGMLQuantizationType.BF16: lambda raw: raw.view(torch.bfloat16).float(),
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}


# Block layouts (ggml): Q4_0 = f16 d, 16 bytes of nibbles (value = (q - 8) * d);
# Q4_1 = f16 d, f16 m, 16 bytes of nibbles (value = q * d + m). Byte j holds element j in
# its low nibble and element j + 16 in its high nibble.
_Q4_HEADER = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}


def int4_blocks(f: GGUFFile, name: str) -> Int4Blocks | None:
    """The 4-bit blocks of a Q4_0 / Q4_1 matrix as codes, scales and offsets; None for any
    other type (those are quantized from their float values if at all)."""
    info = f.tensors[name]
    if len(info.shape) != 2:
        return None
    return int4_of(np.asarray(f.raw(name)), info.qtype, (int(info.shape[1]), int(info.shape[0])))


def int4_of(raw: np.ndarray, qtype, shape: tuple[int, int]) -> Int4Blocks | None:
    """int4_blocks of one matrix's bytes `raw`, shaped (out, in)."""
    header = _Q4_HEADER.get(qtype)
    n, k = shape
    if header is None or k % GROUP:
        return None
    blocks = _bytes(raw).view(n * (k // GROUP), header + GROUP // 2)
    d = _f16_scale(blocks, 0).view(n, k // GROUP)
    offset = _f16_scale(blocks, 2).view(n, k // GROUP) if header == 4 else d * -8.0
    return Int4Blocks(_nibbles(blocks[:, header:]).view(n, k), d, offset)


def q6k_blocks(f: GGUFFile, name: str) -> Q6KBlocks | None:
    """A Q6_K matrix's blocks (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], f16
    d per 256 values) as codes, sub-scales and d; None for any other type."""
    info = f.tensors[name]
    n, k = (int(info.shape[1]), int(info.shape[0])) if len(info.shape) == 2 else (0, 0)
    if info.qtype != GGMLQuantizationType.Q6_K or not n or k % 256:
        return None
    b = _bytes(np.asarray(f.raw(name))).view(n * (k // 256), 210)
    codes = torch.empty(n * (k // 256), 256, dtype=torch.uint8)
    for half in range(2):  # value 128 half + 32 q + l, q < 4, l < 32 (ggml's order)
        ql, qh = b[:, 64 * half:64 * half + 64], b[:, 128 + 32 * half:160 + 32 * half]
        low = (ql[:, :32] & 15, ql[:, 32:] & 15, ql[:, :32] >> 4, ql[:, 32:] >> 4)
        for q in range(4):
            at = 128 * half + 32 * q
            codes[:, at:at + 32] = low[q] | (((qh >> (2 * q)) & 3) << 4)
    sub = b[:, 192:208].contiguous().view(torch.int8)
    d = b[:, 208:210].contiguous().view(torch.float16)
    return Q6KBlocks(codes.view(n, k), sub.reshape(n, k // 16), d.reshape(n, k // 256))


def int8_blocks(f: GGUFFile, name: str) -> Int8Blocks | None:
    """A Q8_0 matrix's blocks (f16 d, 32 int8 codes; value = code * d); None otherwise."""
    info = f.tensors[name]
    if len(info.shape) != 2:
        return None
    return int8_of(np.asarray(f.raw(name)), info.qtype, (int(info.shape[1]), int(info.shape[0])))


def int8_of(raw: np.ndarray, qtype, shape: tuple[int, int]) -> Int8Blocks | None:
    """int8_blocks of one matrix's bytes `raw`, shaped (out, in)."""
    n, k = shape
    if qtype != GGMLQuantizationType.Q8_0:
        return None
    blocks = _bytes(raw).view(n * (k // GROUP), 2 + GROUP)
    return Int8Blocks(blocks[:, 2:].contiguous().view(torch.int8).view(n, k),
                      _f16_scale(blocks, 0).view(n, k // GROUP))


def load_stage_tensors(f: GGUFFile, cfg: ModelConfig, start: int, end: int,
                       first: bool, last: bool) -> StageTensors:
    """The stage's tensors (read lazily) and the digest of exactly their bytes."""
    names = owned_tensor_names(f, cfg, start, end, first, last)
    out = StageTensors(f, names)
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update(f"{cfg.architecture}:{cfg.n_layers}".encode())
    for name in names:
        info = f.tensors[name]
        hasher.update(f"|{name}:{info.qtype.name}:{info.shape}|".encode())
        hasher.update(memoryview(f.raw(name)))
        out.source_bytes += info.nbytes
    out.digest = hasher.hexdigest()
    return out
