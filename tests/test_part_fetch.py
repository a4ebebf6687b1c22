"""Package parts fetched from a node that holds them (mesh/stage/part_fetch.py), over real
gRPC servers on loopback with the cluster's token and mutual TLS: 1 MiB blocks each checked
on receipt, a block damaged in transit fetched again, a cut transfer resumed from its last
verified block, a whole part with the wrong BLAKE3 refused, a slow holder waited for and a
silent one left for the next."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from blake3 import blake3

from skippy.cache.blocks import BLOCK_SIZE
from skippy.mesh.progress import progress_bar
from skippy.mesh.stage.part_fetch import PartError, PartFetcher
from skippy.mesh.stage.part_service import PartsServicer, serve_parts
from skippy.mesh.stage.security import ClusterCredentials, new_secret
from skippy.mesh.stage.stage_parts import PartSource, local_package
from skippy.topology.model_package import PackageManifest, PartEntry
from skippy.topology.tally import Tally

DIGEST = "ab" * 32
SIZE = 3 * BLOCK_SIZE + 12345   # four blocks, the last short


def _package(folder: Path, files: dict[str, bytes]) -> PackageManifest:
    """A package folder: a manifest listing `files` (no tensors: the fetcher moves bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, (name, data) in enumerate(files.items()):
        (folder / name).write_bytes(data)
        parts.append(PartEntry(name.removesuffix(".gguf"), name, "layer", i, len(data),
                               blake3(data).hexdigest(), ()))
    manifest = PackageManifest(DIGEST, "llama", None, len(files), False, (), tuple(parts))
    (folder / "manifest.json").write_text(manifest.to_json())
    return manifest


class Link(PartsServicer):
    """The holder's service with a faulty link: blocks listed in `flip` leave with one bit
    flipped, once each; the transfer breaks before block `cut`, once; every block waits
    `pace` seconds; before block `hang` the holder falls silent until the caller goes."""

    def __init__(self, path, digest, flip=(), cut=None, pace=0.0, hang=None):
        super().__init__(path, digest)
        self.flip, self.cut, self.pace, self.hang = set(flip), cut, pace, hang
        self.asked: list[int] = []   # first_block of each request

    def GetPart(self, request, context):
        self.asked.append(request.first_block)
        self.context = context
        yield from super().GetPart(request, context)

    def _on_wire(self, file, index, data):
        time.sleep(self.pace)
        if index == self.hang:
            self.hang = None
            while self.context.is_active():
                time.sleep(0.02)
            raise ConnectionError("the caller left")
        if index == self.cut:
            self.cut = None
            raise ConnectionError("link dropped")
        if index in self.flip:
            self.flip.discard(index)
            data[100] ^= 0x08
        return bytes(data)


@pytest.fixture(scope="module")
def cluster():
    return ClusterCredentials(new_secret(), tls=True)


@pytest.fixture
def holder(tmp_path, cluster):
    """A holder of a two-part package, serving it over TLS; yields (servicer, address,
    manifest, start) where start(**faults) swaps in a faulty link."""
    data = {"layer-000.gguf": os.urandom(SIZE), "layer-001.gguf": os.urandom(BLOCK_SIZE)}
    manifest = _package(tmp_path / "held", data)
    servers = []

    def start(**faults):
        servicer = Link(tmp_path / "held", DIGEST, **faults)
        rpc, address = serve_parts(servicer, "127.0.0.1", cluster.issue())
        servers.append(rpc)
        return servicer, address

    yield start, manifest, data
    for rpc in servers:
        rpc.stop(None)


def _fetcher(cluster, *addresses, silence_s=30.0):
    return PartFetcher(addresses, cluster.issue(), DIGEST, silence_s=silence_s)


def test_a_part_arrives_whole_in_verified_blocks(holder, cluster, tmp_path):
    start, manifest, data = holder
    servicer, address = start()
    fetcher = _fetcher(cluster, address)
    lines: list[str] = []
    with progress_bar(SIZE, "parts", "B", say=lines.append) as bar:
        got = fetcher.fetch(manifest.parts[0], tmp_path / "here", Tally(SIZE, bar.to))
    fetcher.close()
    assert (tmp_path / "here" / "layer-000.gguf").read_bytes() == data["layer-000.gguf"]
    assert (got.bytes, got.damaged, got.resumed) == (SIZE, 0, 0)
    assert servicer.served == SIZE and bar.n == SIZE
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["layer-000.gguf"]
    assert lines[-1].startswith("parts: 100% ") and "B/s" in lines[-1], lines
    assert "<" in lines[-1], lines  # tqdm's elapsed<remaining: the ETA


def test_a_block_damaged_in_transit_is_detected_and_fetched_again(holder, cluster, tmp_path):
    start, manifest, data = holder
    servicer, address = start(flip={1})
    fetcher = _fetcher(cluster, address)
    got = fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert (tmp_path / "here" / "layer-000.gguf").read_bytes() == data["layer-000.gguf"]
    assert got.damaged == 1 and got.bytes == SIZE
    assert servicer.asked == [0, 1]   # asked again from the damaged block on


def test_a_cut_transfer_resumes_from_its_last_verified_block(holder, cluster, tmp_path):
    start, manifest, data = holder
    _, address = start(cut=2)
    fetcher = _fetcher(cluster, address)
    with pytest.raises(PartError, match="layer-000.gguf"):
        fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert not (tmp_path / "here" / "layer-000.gguf").exists()
    assert (tmp_path / "here" / "layer-000.gguf.partial").stat().st_size == 2 * BLOCK_SIZE
    # a new fetcher (a restarted stage) asks only for the blocks after the verified ones
    servicer, address = start()
    fetcher = _fetcher(cluster, address)
    got = fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert (tmp_path / "here" / "layer-000.gguf").read_bytes() == data["layer-000.gguf"]
    assert got.resumed == 2 * BLOCK_SIZE and got.bytes == SIZE - 2 * BLOCK_SIZE
    assert servicer.asked == [2] and servicer.served == SIZE - 2 * BLOCK_SIZE


def _whole(fetcher, manifest, data, tmp_path):
    """Part 0 fetched into tmp_path/here by `fetcher` (then closed), checked whole."""
    got = fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert (tmp_path / "here" / "layer-000.gguf").read_bytes() == data["layer-000.gguf"]
    return got


def test_a_slow_steady_holder_is_waited_for_however_long_the_whole_part_takes(
        holder, cluster, tmp_path):
    """The deadline is on silence: 4 blocks 0.4 s apart (1.6 s, past a whole-stream
    deadline of 0.6 s) arrive whole."""
    start, manifest, data = holder
    _, address = start(pace=0.4)
    got = _whole(_fetcher(cluster, address, silence_s=0.6), manifest, data, tmp_path)
    assert got.bytes == SIZE


def test_a_holder_that_falls_silent_is_left_for_the_next(holder, cluster, tmp_path):
    start, manifest, data = holder
    silent, first = start(hang=2)
    servicer, second = start()
    t0 = time.monotonic()
    got = _whole(_fetcher(cluster, first, second, silence_s=0.5), manifest, data, tmp_path)
    took = time.monotonic() - t0
    assert silent.asked == [0] and servicer.asked == [2]   # the second resumes at block 2
    assert got.bytes == SIZE and 0.5 <= took < 5, took


def test_a_partial_block_damaged_on_disk_is_fetched_again(holder, cluster, tmp_path):
    start, manifest, data = holder
    _, address = start(cut=3)
    fetcher = _fetcher(cluster, address)
    with pytest.raises(PartError):
        fetcher.fetch(manifest.parts[0], tmp_path / "here")
    partial = tmp_path / "here" / "layer-000.gguf.partial"
    raw = bytearray(partial.read_bytes())
    raw[BLOCK_SIZE + 5] ^= 1   # block 1 rots on disk: blocks 1 and 2 are fetched again
    partial.write_bytes(raw)
    got = fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert (tmp_path / "here" / "layer-000.gguf").read_bytes() == data["layer-000.gguf"]
    assert got.resumed == BLOCK_SIZE


def test_a_part_whose_whole_hash_is_wrong_is_refused(holder, cluster, tmp_path):
    start, manifest, _ = holder
    _, address = start()
    wrong = dataclasses.replace(manifest.parts[0], blake3="00" * 32)
    fetcher = _fetcher(cluster, address)
    with pytest.raises(PartError, match="refused"):
        fetcher.fetch(wrong, tmp_path / "here")
    fetcher.close()
    assert list((tmp_path / "here").iterdir()) == []   # nothing kept, not even a partial


def test_parts_of_another_model_or_outside_the_package_are_not_served(holder, cluster,
                                                                      tmp_path):
    start, manifest, _ = holder
    _, address = start()
    other = PartFetcher([address], cluster.issue(), "cd" * 32)
    with pytest.raises(PartError, match="NOT_FOUND"):
        other.fetch(manifest.parts[0], tmp_path / "here")
    other.close()
    fetcher = _fetcher(cluster, address)
    outside = dataclasses.replace(manifest.parts[0], file="manifest.json")
    with pytest.raises(PartError, match="NOT_FOUND"):
        fetcher.fetch(outside, tmp_path / "here")
    fetcher.close()


def test_a_caller_without_the_cluster_certificate_gets_nothing(holder, tmp_path):
    start, manifest, _ = holder
    servicer, address = start()
    stranger = ClusterCredentials(new_secret(), tls=True).issue()
    fetcher = PartFetcher([address], stranger, DIGEST)
    with pytest.raises(PartError, match="UNAVAILABLE"):
        fetcher.fetch(manifest.parts[0], tmp_path / "here")
    fetcher.close()
    assert servicer.served == 0


def test_a_stage_fetches_only_its_own_parts_into_its_home_once(holder, cluster, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("SKIPPY_HOME", str(tmp_path / "home"))
    start, manifest, data = holder
    servicer, address = start()
    source = PartSource(str(tmp_path / "not-here"), manifest.to_json(), ("layer-001.gguf",),
                        (address,))
    where = Path(local_package(source, cluster.issue()))
    assert where == tmp_path / "home" / "packages" / DIGEST
    assert sorted(p.name for p in where.iterdir() if not p.name.startswith(".")) == \
        ["layer-001.gguf", "manifest.json"]
    assert (where / "layer-001.gguf").read_bytes() == data["layer-001.gguf"]
    assert servicer.served == BLOCK_SIZE
    assert local_package(source, cluster.issue()) == str(where)   # kept: not fetched again
    assert servicer.served == BLOCK_SIZE
    # a node that holds the package at the head's path reads it there
    held = dataclasses.replace(source, path=str(tmp_path / "held"))
    assert local_package(held, cluster.issue()) == str(tmp_path / "held")
