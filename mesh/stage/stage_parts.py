"""A stage's package parts on its own node, fetched there first if they are not.

The engine hands each stage of a package a `PartSource`: the head's manifest, the parts the
stage reads, and the addresses of nodes serving parts (mesh/stage/part_service.py). Before
the stage loads, `local_package` finds a folder of this node holding all of them (the path
serve was given, or this node's own package folder), else fetches what its own folder lacks
(mesh/stage/part_fetch.py) and returns that folder. Parts already in the own folder are
checked against the manifest's BLAKE3 first; one that fails is fetched again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from skippy.topology.model_package import (MANIFEST, PackageError, PackageManifest, PartEntry,
                                           check_part)
from skippy.topology.tally import Tally

from ..progress import progress_bar
from .part_fetch import PartError, PartFetcher
from .part_store import package_home
from .security import StageCredentials

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartSource:
    """Where a stage's parts are and what they must be."""
    path: str                     # the package's path on the head (and maybe here)
    manifest: str                 # the head's manifest.json, as text
    files: tuple[str, ...]        # the part files this stage reads
    holders: tuple[str, ...] = ()  # addresses of nodes serving the parts


def local_package(source: PartSource, credentials: StageCredentials) -> str:
    """A folder of this node that holds the stage's parts, fetching them if need be."""
    manifest = PackageManifest.from_json(source.manifest, "the head's manifest")
    parts = [p for p in manifest.parts if p.file in source.files]
    if len(parts) != len(set(source.files)):
        raise PackageError("the manifest does not list every part the stage reads")
    if _has_all(Path(source.path), manifest, parts):
        return source.path
    home = package_home(manifest.model_digest)
    home.mkdir(parents=True, exist_ok=True)
    _write_manifest(home, source.manifest)
    wanted = [p for p in parts if not _verified(home, p)]
    if not wanted:
        return str(home)
    if not source.holders:
        raise PartError(f"{len(wanted)} part(s) of this stage are on no node that serves them")
    total = sum(p.size for p in wanted)
    log.info("fetching %d part(s), %.1f MiB, into %s from %s", len(wanted), total / 2**20,
             home, ", ".join(source.holders))
    fetcher = PartFetcher(source.holders, credentials, manifest.model_digest)
    received = damaged = resumed = 0
    start = time.monotonic()
    try:
        with progress_bar(total, "parts", "B", say=log.info) as bar:
            fetched = Tally(total, bar.to)
            for part in wanted:
                with _locked(home / f".{part.file}.lock"):
                    if _verified(home, part):  # another stage of this node fetched it
                        continue
                    got = fetcher.fetch(part, home, fetched)
                received += got.bytes
                damaged, resumed = damaged + got.damaged, resumed + got.resumed
    finally:
        fetcher.close()
    seconds = time.monotonic() - start
    log.info("fetched %d part(s): %d bytes received (%d kept from an earlier fetch) in "
             "%.2f s, %.1f MiB/s, %d damaged block(s) fetched again", len(wanted), received,
             resumed, seconds, received / 2**20 / max(seconds, 1e-9), damaged)
    return str(home)


@contextlib.contextmanager
def _locked(path: Path):
    """One fetch of a part at a time on this node: stages sharing it wait for the first."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _has_all(folder: Path, manifest: PackageManifest, parts: list[PartEntry]) -> bool:
    """Whether `folder` holds this model's package with every part at its size (the
    stage checks each part's BLAKE3 as it opens it)."""
    try:
        if PackageManifest.load(folder).model_digest != manifest.model_digest:
            return False
    except PackageError:
        return False
    return all((folder / p.file).is_file() and (folder / p.file).stat().st_size == p.size
               for p in parts)


def _verified(folder: Path, part: PartEntry) -> bool:
    """Whether `folder` holds `part` whole; a damaged copy is removed."""
    if not (folder / part.file).is_file():
        return False
    try:
        check_part(folder, part)
        return True
    except PackageError:
        log.warning("%s: part %s does not match the manifest; fetching it again",
                    folder, part.file)
        (folder / part.file).unlink()
        return False


def _write_manifest(folder: Path, text: str) -> None:
    """The head's manifest in this node's folder (atomically: a reader never sees half)."""
    target = folder / MANIFEST
    if target.is_file() and target.read_text() == text:
        return
    tmp = folder / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, target)
