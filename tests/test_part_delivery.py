"""Package parts delivered between hosts that really are separate (tests/hosts.py): a
package split from SmolLM2 is on host 1 only; `skippy serve --package` on host 1 puts one
stage on each host, and hosts 2 and 3 fetch exactly the parts of their own stages, over
the stage network, into their own SKIPPY_HOME; the answer is the in-process pipeline's on
the GGUF. Prints the fetch throughput of each host.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ray")

from hosts import (RAY_PORT, greedy_chat, planned, ray_nodes,  # noqa: E402
                   serving)
from skippy.topology.model_package import PackageManifest  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8010
CTX = 1024
QUESTION = "What is the capital of France?"
FETCHED = re.compile(r"fetched (\d+) part\(s\): (\d+) bytes received \((\d+) kept from an "
                     r"earlier fetch\) in ([\d.]+) s, ([\d.]+) MiB/s, (\d+) damaged")


@pytest.fixture(scope="module")
def package(hosts, smollm2):
    """The package, split into host 1's own root: no other host can read it."""
    from skippy.stages.package import split_package
    out = hosts[0].root / "smollm2-package"
    split_package(smollm2, out)
    return out


@pytest.fixture(scope="module")
def serve_log(hosts, package):
    head = hosts[0]
    with serving(head, PORT, "--package", str(package), "--stages", "3", "--ctx", str(CTX),
                 "--lanes", "1", "--weight-format", "int4") as log:
        yield log.read_text()


def own_parts(manifest: PackageManifest, start: int, end: int, first: bool, last: bool
              ) -> set[str]:
    """The part files a stage reads, by the package's layout (topology/model_package.py):
    shared always, its layers, embeddings at the first stage (and the last of a tied model),
    output at the last."""
    roles = {"shared"} | ({"embeddings"} if first or (last and manifest.tied_head) else set()) \
        | ({"output"} if last else set())
    return {p.file for p in manifest.parts
            if p.role in roles or (p.layer is not None and start <= p.layer < end)}


def fetch_lines(host) -> list[tuple[int, ...]]:
    """The 'fetched ...' log lines of the stage actors of `host` (its own Ray logs)."""
    found = []
    logs = {p.resolve() for p in (host.root / "ray").glob("session_*/logs/worker-*")}
    for path in logs:   # session_latest links to the session: each file once
        for m in FETCHED.finditer(path.read_text(errors="replace")):
            found.append((int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5]),
                          int(m[6])))
    return found


def test_each_host_fetches_exactly_its_own_parts(hosts, package, serve_log):
    manifest = PackageManifest.load(package)
    nodes = ray_nodes(f"{hosts[0].ip}:{RAY_PORT}")
    stages = planned(serve_log)
    for i, (host, (start, end, node)) in enumerate(zip(hosts, stages)):
        assert nodes[host.ip].startswith(node), (host.ip, node, nodes)
        folder = host.root / "home" / "skippy" / "packages" / manifest.model_digest
        if i == 0:   # host 1 holds the package at the path serve was given
            assert not folder.exists() and fetch_lines(host) == []
            continue
        want = own_parts(manifest, start, end, first=False, last=i == len(stages) - 1)
        held = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
        assert held == want | {"manifest.json"}, (i, held, want)
        want_bytes = sum(p.size for p in manifest.parts if p.file in want)
        [(n_parts, got, kept, seconds, rate, damaged)] = fetch_lines(host)
        assert (n_parts, got, kept, damaged) == (len(want), want_bytes, 0, 0)
        print(f"host {i + 1}: fetched {n_parts} parts, {got / 2**20:.1f} MiB in {seconds:.2f} s "
              f"= {rate:.1f} MiB/s (TLS, 1 MiB blocks, each BLAKE3-checked)")


def test_greedy_chat_matches_the_in_process_pipeline_on_the_gguf(hosts, serve_log, smollm2):
    got, want, tok = greedy_chat(f"http://{hosts[0].ip}:{PORT}/v1", smollm2,
                                 [(a, b) for a, b, _ in planned(serve_log)], QUESTION,
                                 n_ctx=CTX)
    assert want and got == tok.decode(want)
