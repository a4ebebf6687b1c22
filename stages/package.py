"""Split a GGUF (or a split-GGUF set) by layer into a package (topology/model_package.py).

The splitter streams: each part's header is written from the source's own metadata bytes
(every entry copied verbatim, so each value keeps its exact GGUF type), then each tensor's
bytes are copied through one fixed buffer. Nothing is dequantized and no source file is
memory-mapped past its header, so the splitter's memory stays about one copy buffer
whatever the model's size. Each part is hashed as it is written and appears atomically
(written under a temporary name, synced to disk, then renamed); the manifest is written
last the same way, so an interrupted split, or a crash after it, never leaves a package
that looks complete.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from skippy.topology.families import FAMILIES
from skippy.topology.gguf_file import GGUF_MAGIC, GGUFFile, TensorInfo
from skippy.topology.model_package import (EMBEDDINGS, LAYER, MANIFEST, OUTPUT, SHARED,
                                           PackageManifest, PackageError, PartEntry)
from skippy.topology.tally import Progress, Tally
from skippy.topology.planner import gguf_model_digest

PART_GGUF_VERSION = 3
COPY_BUFFER = 16 * 2**20

_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class _Part:
    name: str
    role: str
    layer: int | None = None
    # (source file, tensor) in source order
    tensors: list[tuple[GGUFFile, TensorInfo]] = field(default_factory=list)

    @property
    def file(self) -> str:
        return f"{self.name}.gguf"


def source_files(model: str | Path) -> list[Path]:
    """The file, or every shard of a split set named by any of its shards
    (`name-00001-of-00003.gguf`); raises PackageError naming a missing shard."""
    model = Path(model)
    m = _SHARD.match(model.name)
    if m is None:
        if not model.is_file():
            raise PackageError(f"no such model file: {model}")
        return [model]
    count = int(m["count"])
    files = [model.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    for f in files:
        if not f.is_file():
            raise PackageError(f"split set {m['stem']}: shard {f.name} is missing")
    return files


def split_package(model: str | Path, out_dir: str | Path,
                  progress: Progress | None = None) -> PackageManifest:
    """Write `model` (a GGUF file or split set) as a package in `out_dir` (new or empty);
    return its manifest. `progress(done, total)` hears the tensor bytes copied so far."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackageError(f"{out} exists and is not an empty directory")
    files = source_files(model)
    sources = [GGUFFile(p) for p in files]
    try:
        first = sources[0]
        arch = first.architecture
        n_layers = first.arch_key("block_count")
        if n_layers is None:
            raise PackageError(f"{files[0].name}: no {arch}.block_count; cannot split by layer")
        n_layers = int(n_layers)
        family = FAMILIES.get(arch)
        parts = _assign_parts(sources, n_layers,
                              family.output_norm if family else "output_norm.weight")
        keys = [k for k in first.kv_spans if not k.startswith("split.")]
        full_kv = [first.kv_entry(k) for k in keys]
        # Only the shared part carries the tokenizer: it is the bulk of the metadata and a
        # layer has no use for it.
        slim_kv = [first.kv_entry(k) for k in keys if not k.startswith("tokenizer.")]
        align = int(first.metadata.get("general.alignment", 32))
        names = [t.name for _, t in (x for p in parts for x in p.tensors)]
        if len(set(names)) != len(names):
            raise PackageError(f"{files[0].name}: a tensor name occurs twice in the set")
        digest = _model_digest(sources)
        out.mkdir(parents=True, exist_ok=True)
        entries = []
        copied = Tally(sum(t.nbytes for p in parts for _, t in p.tensors), progress)
        for part in parts:
            size, digest_hex = _write_part(out / part.file, part,
                                           full_kv if part.role == SHARED else slim_kv, align,
                                           copied)
            entries.append(PartEntry(part.name, part.file, part.role, part.layer, size,
                                     digest_hex, tuple(t for _, t in part.tensors)))
        manifest = PackageManifest(model_digest=digest, architecture=arch,
                            family=family.name if family else None, n_layers=n_layers,
                            tied_head="output.weight" not in names,
                            source=tuple(p.name for p in files), parts=tuple(entries))
        _write_durably(out / MANIFEST, manifest.to_json().encode())
        return manifest
    finally:
        for s in sources:
            s.close()


def _assign_parts(sources: list[GGUFFile], n_layers: int, output_norm: str) -> list[_Part]:
    shared, embeddings, output = _Part(SHARED, SHARED), _Part(EMBEDDINGS, EMBEDDINGS), \
        _Part(OUTPUT, OUTPUT)
    width = max(3, len(str(n_layers - 1)))
    layers = [_Part(f"layer-{i:0{width}d}", LAYER, i) for i in range(n_layers)]
    for src in sources:
        for info in sorted(src.tensors.values(), key=lambda t: t.offset):
            name = info.name
            if name.startswith("blk."):
                index = int(name.split(".")[1])
                if not 0 <= index < n_layers:
                    raise PackageError(f"{src.path.name}: tensor {name} is outside the "
                                       f"model's {n_layers} layers")
                layers[index].tensors.append((src, info))
            elif name == "token_embd.weight":
                embeddings.tensors.append((src, info))
            elif name in ("output.weight", output_norm):
                output.tensors.append((src, info))
            else:
                shared.tensors.append((src, info))
    if not embeddings.tensors:
        raise PackageError(f"{sources[0].path.name}: no token_embd.weight")
    return [shared, embeddings, *layers, output]


def _model_digest(sources: list[GGUFFile]) -> str:
    # One file: the digest the planner computes from the GGUF itself, so the package and
    # its source name the same model (same topology digests, same plans).
    if len(sources) == 1:
        return gguf_model_digest(sources[0])
    h = blake3.blake3()
    h.update(b"skippy-split-set-v1|")
    for s in sources:
        h.update(gguf_model_digest(s).encode())
    return h.hexdigest()


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _write_part(path: Path, part: _Part, kv: list[bytes], align: int,
                copied: Tally) -> tuple[int, str]:
    """One GGUF: header, the given metadata entries, this part's tensor index, then the
    tensors' bytes copied from their sources. Returns (size, BLAKE3)."""
    index = bytearray()
    rel = 0
    for _, t in part.tensors:
        index += _gguf_string(t.name)
        index += struct.pack("<I", len(t.shape))
        index += struct.pack(f"<{len(t.shape)}Q", *t.shape)
        index += struct.pack("<IQ", int(t.qtype), rel)
        rel += _pad(t.nbytes, align)
    header = GGUF_MAGIC + struct.pack("<IQQ", PART_GGUF_VERSION, len(part.tensors), len(kv))
    head = header + b"".join(kv) + bytes(index)
    head += bytes(_pad(len(head), align) - len(head))
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    tmp = path.with_name(path.name + ".partial")
    buf = bytearray(COPY_BUFFER)
    try:
        with open(tmp, "wb") as fh:
            _emit(fh, h, head)
            for src, t in part.tensors:
                _copy(src, t, fh, h, buf, copied)
                _emit(fh, h, bytes(_pad(t.nbytes, align) - t.nbytes))
            size = fh.tell()
            fh.flush()
            os.fsync(fh.fileno())  # on disk before the rename publishes it
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return size, h.hexdigest()


def _write_durably(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, surviving a crash: the bytes reach the disk under a
    temporary name before the rename, and the rename before we return."""
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the directory entries: the parts' renames and the manifest's
    finally:
        os.close(fd)


def _emit(fh, h, data) -> None:
    fh.write(data)
    h.update(data)


def _copy(src: GGUFFile, t: TensorInfo, fh, h, buf: bytearray, copied: Tally) -> None:
    # pread into one buffer, not the source's memory map: mapped pages would count as the
    # splitter's memory and grow with the model.
    view = memoryview(buf)
    fd = os.open(src.path, os.O_RDONLY)
    try:
        pos, left = t.offset, t.nbytes
        while left:
            n = os.preadv(fd, [view[:min(left, len(buf))]], pos)
            if n <= 0:
                raise PackageError(f"{src.path.name}: tensor {t.name} is truncated")
            _emit(fh, h, view[:n])
            copied.add(n)
            pos += n
            left -= n
    finally:
        os.close(fd)


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align
