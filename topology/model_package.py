"""A model package: one model split by layer into GGUF parts, plus a manifest of hashes.

A package directory holds `manifest.json` and these parts, each a valid GGUF that carries
the model's metadata (so gguf tools can read any part on its own):

- `shared.gguf`: all metadata, the tokenizer included, and the small tensors that belong
  to no layer and neither end (rope tables and the like); every stage opens it.
- `embeddings.gguf`: the token embeddings (stage 0; also the last stage of a tied model).
- `output.gguf`: the final norm and, when untied, the output head (the last stage).
- `layer-NNN.gguf`: the tensors of one layer.

Tensors keep the bytes of the original file, quantization included, so a stage loaded from
a package holds bitwise the same weights as one loaded from the GGUF. `ModelPackage` reads
a package through the same interface as `GGUFFile` (metadata, tensor index, `raw`), and
opens a part only when one of its tensors is read, checking the part's BLAKE3 on the open
file it then reads from (package_part.py): a stage never reads, hashes or maps another
stage's parts. The model digest is written by the splitter into the manifest; nothing
hashes the whole model at load. A manifest names each part by a plain file name in the
package directory; one naming anything else (`..`, a separator, an absolute path) is
refused when it is loaded.

`open_model(path)` is the one place that decides between a GGUF file and a package.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from .gguf_file import GGUFFile, TensorInfo
from .package_part import OpenPart, PackageError, hash_fd, open_part_file
from .tally import Progress, Tally

MANIFEST = "manifest.json"
PACKAGE_FORMAT = "skippy-package"
PACKAGE_VERSION = 1

# Roles of parts; "layer" parts also carry their layer index.
SHARED, EMBEDDINGS, OUTPUT, LAYER = "shared", "embeddings", "output", "layer"


@dataclass(frozen=True)
class PartEntry:
    """One part as the manifest lists it."""

    name: str                  # "shared", "embeddings", "output", "layer-007"
    file: str
    role: str
    layer: int | None
    size: int
    blake3: str
    tensors: tuple[TensorInfo, ...]  # offsets are package-wide order, not file offsets


@dataclass(frozen=True)
class PackageManifest:
    model_digest: str
    architecture: str
    family: str | None
    n_layers: int
    tied_head: bool
    source: tuple[str, ...]
    parts: tuple[PartEntry, ...]

    def to_json(self) -> str:
        return json.dumps({
            "format": PACKAGE_FORMAT,
            "version": PACKAGE_VERSION,
            "model_digest": self.model_digest,
            "architecture": self.architecture,
            "family": self.family,
            "n_layers": self.n_layers,
            "tied_head": self.tied_head,
            "source": list(self.source),
            "parts": [{
                "name": p.name, "file": p.file, "role": p.role, "layer": p.layer,
                "size": p.size, "blake3": p.blake3,
                "tensors": [{"name": t.name, "shape": list(t.shape), "qtype": t.qtype.name,
                             "nbytes": t.nbytes} for t in p.tensors],
            } for p in self.parts],
        }, indent=1) + "\n"

    @classmethod
    def load(cls, directory: Path) -> PackageManifest:
        """The manifest of the package in `directory`; raises PackageError if it is missing,
        malformed, of another version, or names a part file outside the directory."""
        path = directory / MANIFEST
        if not path.is_file():
            raise PackageError(f"{directory}: not a package (no {MANIFEST})")
        return cls.from_json(path.read_text(), path)

    @classmethod
    def from_json(cls, text: str, path: str | Path = MANIFEST) -> PackageManifest:
        """A manifest from its text (`path` names it in errors), checked as `load` does:
        a manifest may travel between nodes."""
        try:
            d = json.loads(text)
            if d.get("format") != PACKAGE_FORMAT:
                raise PackageError(f"{path}: not a skippy package manifest")
            if d.get("version") != PACKAGE_VERSION:
                raise PackageError(f"{path}: package version {d.get('version')} is not "
                                   f"supported (this skippy reads {PACKAGE_VERSION})")
            parts = _parts_from_json(d["parts"])
            manifest = cls(str(d["model_digest"]), str(d["architecture"]), d.get("family"),
                           int(d["n_layers"]), bool(d["tied_head"]),
                           tuple(d.get("source", ())), parts)
        except PackageError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PackageError(f"{path}: malformed manifest ({e!r})") from None
        _check_part_names(path, manifest.parts)
        return manifest

    def part(self, name: str) -> PartEntry:
        for p in self.parts:
            if p.name == name:
                return p
        raise PackageError(f"package has no part {name!r}")


def _parts_from_json(entries: list[dict]) -> tuple[PartEntry, ...]:
    order = 0  # TensorInfo.offset: the tensor's place in package order
    parts = []
    for p in entries:
        infos = []
        for t in p["tensors"]:
            infos.append(TensorInfo(t["name"], tuple(int(x) for x in t["shape"]),
                                    GGMLQuantizationType[t["qtype"]], order, int(t["nbytes"])))
            order += 1
        layer = p.get("layer")
        parts.append(PartEntry(_text(p, "name"), _text(p, "file"), str(p["role"]),
                               None if layer is None else int(layer), int(p["size"]),
                               str(p["blake3"]), tuple(infos)))
    return tuple(parts)


def _text(entry: dict, key: str) -> str:
    value = entry[key]
    if not isinstance(value, str):
        raise TypeError(f"part {key} {value!r} is not a string")
    return value


def unsafe_name_reason(name: str) -> str | None:
    """Why `name` cannot be a part's name or file (a bare file name inside the package
    directory), or None if it can."""
    if not name:
        return "it is empty"
    if "\0" in name:
        return "it holds a NUL byte"
    if os.path.isabs(name):
        return "it is an absolute path"
    if "/" in name or "\\" in name:
        return "it holds a path separator (a part is a file in the package directory)"
    if ".." in name:
        return "it holds '..'"
    if name == ".":
        return "it names the directory"
    return None


def _check_part_names(path: Path, parts: tuple[PartEntry, ...]) -> None:
    # A manifest may come from elsewhere (copied with its parts): a part file must be a
    # plain name in the package directory, never a path that reaches out of it.
    files: set[str] = set()
    for p in parts:
        for field, value in (("name", p.name), ("file", p.file)):
            reason = unsafe_name_reason(value)
            if reason is not None:
                raise PackageError(f"{path}: part {field} {value!r} is not allowed: {reason}")
        if p.file in files:
            raise PackageError(f"{path}: part file {p.file!r} is listed twice")
        files.add(p.file)


def is_package(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_part(directory: Path, part: PartEntry,
               on_bytes: Callable[[int], None] | None = None) -> None:
    """Raise PackageError naming the part unless its file exists with the manifest's size
    and BLAKE3 (size and bytes both read through one open descriptor). `on_bytes(n)`
    hears each chunk hashed."""
    fd = open_part_file(directory, part.file, part.size)
    try:
        digest = hash_fd(fd, part.size, f"{directory}: part {part.file}", on_bytes)
    finally:
        os.close(fd)
    if digest != part.blake3:
        raise PackageError(f"{directory}: part {part.file} is corrupted (BLAKE3 mismatch)")


def verify_package(directory: str | Path, progress: Progress | None = None,
                   *, held_only: bool = False) -> PackageManifest:
    """Check every part's size and BLAKE3; raise PackageError naming the first bad one.
    `held_only`: parts absent here are skipped (a cluster's nodes fetch them from a node
    that holds them), but for the shared part, which the metadata and tokenizer come from.
    `progress(done, total)` hears the bytes hashed so far."""
    directory = Path(directory)
    manifest = PackageManifest.load(directory)
    parts = [p for p in manifest.parts
             if not held_only or p.role == SHARED or (directory / p.file).exists()]
    hashed = Tally(sum(p.size for p in parts), progress)
    for part in parts:
        check_part(directory, part, hashed.add)
    return manifest


def layers_present(directory: str | Path, model_digest: str) -> frozenset[int]:
    """The layers whose parts are in `directory` at their manifest size, if it holds a
    package of this model; empty otherwise. Sizes only: a stage checks each part's hash
    as it opens it."""
    directory = Path(directory)
    try:
        manifest = PackageManifest.load(directory)
    except PackageError:
        return frozenset()
    if manifest.model_digest != model_digest:
        return frozenset()
    out = set()
    for part in manifest.parts:
        path = directory / part.file
        if part.layer is not None and path.is_file() and path.stat().st_size == part.size:
            out.add(part.layer)
    return frozenset(out)


class ModelPackage:
    """A package read like a `GGUFFile`: metadata and the tensor index of the whole model,
    tensor bytes only from the parts actually read. Each part is opened once, when first
    needed, and hash-checked on that open file; reads come only from it (package_part.py)."""

    def __init__(self, directory: str | Path, *, verify: bool = True):
        self.path = Path(directory)
        self.manifest = PackageManifest.load(self.path)
        self.model_digest = self.manifest.model_digest
        self._verify = verify
        self._open: dict[str, OpenPart] = {}
        self._part_of: dict[str, PartEntry] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for part in self.manifest.parts:
            for info in part.tensors:
                self.tensors[info.name] = info
                self._part_of[info.name] = part
        self._last: tuple[str, weakref.ref] | None = None
        self._shared = self._part(self.manifest.part(SHARED)).header
        self.metadata = self._shared.metadata

    # -- GGUFFile's interface ----------------------------------------------------------------
    def get(self, key: str, default=None):
        return self._shared.get(key, default)

    @property
    def architecture(self) -> str:
        return self._shared.architecture

    def arch_key(self, suffix: str, default=None):
        return self._shared.arch_key(suffix, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, read from its part (a copy: no mapping outlives the read)."""
        part = self._part(self._part_of[name])
        # The loader may read a tensor twice in a row (its values, then its 4-bit blocks)
        # while it holds the first read: hand back that same array rather than a second
        # copy of a possibly huge tensor; held weakly, so nothing outlives that use.
        if self._last is not None and self._last[0] == name:
            data = self._last[1]()
            if data is not None:
                return data
        data = part.raw(name)
        self._last = (name, weakref.ref(data))
        return data

    def close(self) -> None:
        self._last = None
        for part in self._open.values():
            part.close()
        self._open.clear()

    # -- package ---------------------------------------------------------------------------
    def parts_for(self, names: Iterable[str]) -> list[PartEntry]:
        """The parts holding these tensors, in package order."""
        wanted = {self._part_of[n].name for n in names}
        return [p for p in self.manifest.parts if p.name in wanted]

    def _part(self, entry: PartEntry) -> OpenPart:
        part = self._open.get(entry.name)
        if part is None:
            part = OpenPart(self.path, entry.file, entry.size,
                            entry.blake3 if self._verify else None)
            for t in entry.tensors:
                got = part.header.tensors.get(t.name)
                if got is None or (got.shape, got.qtype, got.nbytes) != \
                        (t.shape, t.qtype, t.nbytes):
                    part.close()
                    raise PackageError(f"{self.path}: part {entry.file} does not hold "
                                       f"{t.name} as the manifest says")
            self._open[entry.name] = part
        return part


def open_model(path: str | Path, *, verify: bool = True) -> GGUFFile | ModelPackage:
    """A GGUF file or a package directory, read through the same interface."""
    path = Path(path)
    if path.is_dir():
        return ModelPackage(path, verify=verify)
    return GGUFFile(path)


def metadata_gguf(path: str | Path) -> Path:
    """The GGUF that holds a model's full metadata and tokenizer: the file itself, or a
    package's shared part (for tools that need a file, such as llama.cpp's vocabulary)."""
    path = Path(path)
    if path.is_dir():
        return path / PackageManifest.load(path).part(SHARED).file
    return path
