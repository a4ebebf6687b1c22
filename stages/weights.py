"""Load only what a stage owns from a GGUF: its layers, plus embeddings / head at the ends.

Tensors are dequantized with gguf-py (which handles every GGML type of the shipped
files) straight from the memory-mapped file, one tensor at a time, so a stage never
touches another stage's bytes. The digest covers exactly the bytes loaded: it is the
model-digest part of the cache identity, stable across file names and processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class StageTensors:
    """Float32 tensors of one stage, keyed by GGUF name; Linear layout (out, in)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # The file's own 4-bit blocks of the matrices stored as Q4_0 / Q4_1 (int4 format)
    int4: dict[str, Int4Blocks] = field(default_factory=dict)
    int8: dict[str, Int8Blocks] = field(default_factory=dict)  # Q8_0 matrices
    digest: str = ""
    source_bytes: int = 0  # bytes read from the file (quantized size)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def matrix(self, name: str) -> Matrix:
        """A weight matrix for make_linear: its values and, if stored so, its 4-bit blocks."""
        return Matrix(self.tensors[name], self.int4.get(name), self.int8.get(name))


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


def int4_blocks(f: GGUFFile, name: str) -> Int4Blocks | None:
    """The 4-bit blocks of a Q4_0 / Q4_1 matrix as codes, scales and offsets; None for any
    other type (those are quantized from their float values if at all)."""
    info = f.tensors[name]
    header = _Q4_HEADER.get(info.qtype)
    if header is None or len(info.shape) != 2 or info.shape[0] % GROUP:
        return None
    k, n = info.shape
    blocks = np.asarray(f.raw(name)).reshape(n, k // GROUP, header + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if info.qtype == GGMLQuantizationType.Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8.0 * d
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Int4Blocks(torch.from_numpy(codes.copy()), torch.from_numpy(d),
                      torch.from_numpy(np.ascontiguousarray(offset)))


def int8_blocks(f: GGUFFile, name: str) -> Int8Blocks | None:
    """A Q8_0 matrix's blocks (f16 d, 32 int8 codes; value = code * d); None otherwise."""
    info = f.tensors[name]
    if info.qtype != GGMLQuantizationType.Q8_0 or len(info.shape) != 2:
        return None
    k, n = info.shape
    blocks = np.asarray(f.raw(name)).reshape(n, k // GROUP, 2 + GROUP)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Int8Blocks(torch.from_numpy(codes), torch.from_numpy(d))


def load_stage_tensors(f: GGUFFile, cfg: ModelConfig, start: int, end: int,
                       first: bool, last: bool) -> StageTensors:
    out = StageTensors()
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update(f"{cfg.architecture}:{cfg.n_layers}".encode())
    for name in owned_tensor_names(f, cfg, start, end, first, last):
        info = f.tensors[name]
        raw = f.raw(name)
        hasher.update(f"|{name}:{info.qtype.name}:{info.shape}|".encode())
        hasher.update(memoryview(raw))
        out.source_bytes += info.nbytes
        out.tensors[name] = dequantize_tensor(f, name)
        blocks = int4_blocks(f, name)
        if blocks is not None:
            out.int4[name] = blocks
        q8 = int8_blocks(f, name)
        if q8 is not None:
            out.int8[name] = q8
    out.digest = hasher.hexdigest()
    return out
