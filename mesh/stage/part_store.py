"""Where a node keeps package parts.

A node reads a package where `skippy serve` was pointed at it, when it holds it at that same
path, and otherwise from its own copy under `$SKIPPY_HOME/packages/<model digest>/`: the
folder parts fetched from other nodes fill (mesh/stage/part_fetch.py), and one a user may
pre-seed by copying a package there. The folder is named by the digest, so packages of
different models never mix and a later serve of the same model finds its parts again.
"""

from __future__ import annotations

import re
from pathlib import Path

from skippy.topology.model_package import (PackageManifest, PackageError, PartEntry,
                                           layers_present)

from ..models import model_home

_DIGEST = re.compile(r"[0-9a-f]{16,128}")


def package_home(model_digest: str) -> Path:
    """This node's own folder for the package of `model_digest`."""
    # The digest comes from a manifest, which may come from elsewhere: it names a folder
    # here, so only a plain hex digest may.
    if not _DIGEST.fullmatch(model_digest):
        raise PackageError(f"model digest {model_digest[:80]!r} is not a hex digest")
    return model_home() / "packages" / model_digest


def package_dirs(path: str | Path, model_digest: str) -> list[Path]:
    """The folders of this node that may hold the package: the path, then its own copy
    (none for a digest that cannot name one)."""
    if not _DIGEST.fullmatch(model_digest):
        return [Path(path)]
    return [Path(path), package_home(model_digest)]


def layers_held(path: str | Path, model_digest: str) -> frozenset[int]:
    """The layers whose parts this node holds (by size) in either folder."""
    out: frozenset[int] = frozenset()
    for folder in package_dirs(path, model_digest):
        out |= layers_present(folder, model_digest)
    return out


def holding_dir(path: str | Path, model_digest: str, file: str) -> tuple[Path, PartEntry] | None:
    """The folder that holds part `file` of this model at its manifest size, and the part
    as that folder's manifest lists it; None if neither does."""
    for folder in package_dirs(path, model_digest):
        try:
            manifest = PackageManifest.load(folder)
        except PackageError:
            continue
        if manifest.model_digest != model_digest:
            continue
        entry = next((p for p in manifest.parts if p.file == file), None)
        target = folder / file
        if entry is not None and target.is_file() and target.stat().st_size == entry.size:
            return folder, entry
    return None
