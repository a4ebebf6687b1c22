"""Load only what a stage owns from a GGUF: its layers, plus embeddings / head at the ends.

Tensors are dequantized with gguf-py (which handles every GGML type of the shipped
files) straight from the memory-mapped file, one tensor at a time, so a stage never
touches another stage's bytes. The digest covers exactly the bytes loaded: it is the
model-digest part of the cache identity, stable across file names and processes.
"""

from __future__ import annotations

import blake3
import numpy as np
import torch
from gguf.quants import dequantize

from gguf import GGMLQuantizationType

from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

from .linear import GROUP, Int4Blocks, Int8Blocks, Matrix


class MissingTensor(ValueError):
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

    def matrix(self, name: str) -> Matrix:
        """A weight matrix for make_linear, read now and not kept: its values and, if
        stored so, the file's 4-bit (Q4_0 / Q4_1) or 8-bit (Q8_0) blocks."""
        self._check(name)
        values = self._kept.get(name)
        if values is None:
            values = dequantize_tensor(self.f, name)
        return Matrix(values, int4_blocks(self.f, name), int8_blocks(self.f, name))

    def experts(self, name: str) -> list[Matrix]:
        """A 3-D expert tensor (GGUF {in, out, n_expert}) as one Matrix per expert, read now
        and not kept: each expert's values and, if stored so, its own 4-bit or 8-bit blocks
        (views of the stack's), for make_linear expert by expert."""
        m = self.matrix(name)
        if m.values.ndim != 3:
            raise ValueError(f"{name}: expected a 3-D expert tensor, not {tuple(m.values.shape)}")
        b4, b8 = m.int4, m.int8
        return [Matrix(m.values[e],
                       None if b4 is None else Int4Blocks(b4.codes[e], b4.scale[e], b4.offset[e]),
                       None if b8 is None else Int8Blocks(b8.codes[e], b8.scale[e]))
                for e in range(m.values.shape[0])]


def owned_tensor_names(f: GGUFFile, cfg: ModelConfig, start: int, end: int,
                       first: bool, last: bool) -> list[str]:
    """Names of the tensors a stage [start, end) loads, in file order."""
    prefixes = tuple(f"blk.{i}." for i in range(start, end))
    names = [n for n in f.tensors if n.startswith(prefixes)]
    if first:
        names.append("token_embd.weight")
    if last:
        names.append(cfg.family.output_norm)
        names.append("token_embd.weight" if cfg.tied_head else "output.weight")
    missing = [n for n in names if n not in f.tensors]
    if missing:
        raise MissingTensor(f"{f.path.name}: missing tensor(s) {', '.join(missing[:3])}")
    seen: set[str] = set()
    unique = [n for n in names if not (n in seen or seen.add(n))]
    return sorted(unique, key=lambda n: f.tensors[n].offset)


def dequantize_tensor(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensors[name]
    rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
    raw = np.asarray(f.raw(name)).reshape(rows, -1)
    values = dequantize(raw, info.qtype).astype(np.float32, copy=False)
    return torch.from_numpy(values.reshape(tuple(reversed(info.shape))).copy())


# Block layouts (ggml): Q4_0 = f16 d, 16 bytes of nibbles (value = (q - 8) * d);
# Q4_1 = f16 d, f16 m, 16 bytes of nibbles (value = q * d + m). Byte j holds element j in
# its low nibble and element j + 16 in its high nibble.
_Q4_HEADER = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}


def _block_rows(f: GGUFFile, name: str, block_bytes: int):
    """A 2-D matrix or 3-D stack of matrices (experts) as [rows, blocks, block_bytes], and
    the torch shape (..., out, in) the decoded codes take; None where the inner size is
    not whole blocks or the tensor is not 2-D or 3-D."""
    info = f.tensors[name]
    if len(info.shape) not in (2, 3) or info.shape[0] % GROUP:
        return None
    shape = tuple(int(d) for d in reversed(info.shape))
    rows = int(np.prod(shape[:-1]))
    return np.asarray(f.raw(name)).reshape(rows, shape[-1] // GROUP, block_bytes), shape


def int4_blocks(f: GGUFFile, name: str) -> Int4Blocks | None:
    """The 4-bit blocks of a Q4_0 / Q4_1 matrix (or 3-D expert stack: codes [E, out, in])
    as codes, scales and offsets; None for any other type (those are quantized from their
    float values if at all)."""
    info = f.tensors[name]
    header = _Q4_HEADER.get(info.qtype)
    got = _block_rows(f, name, (header or 0) + GROUP // 2) if header is not None else None
    if got is None:
        return None
    blocks, shape = got
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if info.qtype == GGMLQuantizationType.Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8.0 * d
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(shape)
    groups = shape[:-1] + (shape[-1] // GROUP,)
    return Int4Blocks(torch.from_numpy(codes.copy()), torch.from_numpy(d.reshape(groups)),
                      torch.from_numpy(np.ascontiguousarray(offset).reshape(groups)))


def int8_blocks(f: GGUFFile, name: str) -> Int8Blocks | None:
    """A Q8_0 matrix's (or 3-D expert stack's) blocks (f16 d, 32 int8 codes; value =
    code * d); None otherwise."""
    info = f.tensors[name]
    got = _block_rows(f, name, 2 + GROUP) if info.qtype == GGMLQuantizationType.Q8_0 else None
    if got is None:
        return None
    blocks, shape = got
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(shape)
    return Int8Blocks(torch.from_numpy(codes),
                      torch.from_numpy(d.reshape(shape[:-1] + (shape[-1] // GROUP,))))


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
