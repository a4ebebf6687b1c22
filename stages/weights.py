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

from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig


class MissingTensor(ValueError):
    """The GGUF lacks a tensor this stage needs."""


@dataclass
class StageTensors:
    """Float32 tensors of one stage, keyed by GGUF name; Linear layout (out, in)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: str = ""
    source_bytes: int = 0  # bytes read from the file (quantized size)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


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
    out.digest = hasher.hexdigest()
    return out
