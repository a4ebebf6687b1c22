"""A host lost whose layers fit whole on no host left, on hosts that really are separate
(tests/hosts.py): `skippy serve --package --stages 3` on the three hosts (the package
split from SmolLM2 on host 1 only: hosts 2 and 3 fetch their stages' parts), each stage
filling most of its host (10 lanes of 8,192 tokens), the f32 wire; host 3 killed (every
process in its namespace, SIGKILL) under 4 greedy streams. The model is cut anew over
hosts 1 and 2, host 2 fetching the parts of its new layers from host 1, every stream
finishes with the fault-free text (on the f32 wire a cut moves no number), and the
status page shows the new plan. tests/test_recut.py checks the f16 wire's continuation
(and a GGUF file's re-cut) on Ray nodes that share one namespace.
Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

pytest.importorskip("ray")

from hosts import RAY_PORT, Streams, kill_host, planned, ray_nodes, serving  # noqa: E402
from test_host_loss import MAX_TOKENS, QUESTIONS, fault_free  # noqa: E402
from test_part_delivery import fetch_lines  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8004
CUT_LINE = re.compile(r"pipeline 0: cut anew over the alive nodes: (\d+) stage\(s\), "
                      r"topology (\w+) \(was (\w+)\)")


@pytest.fixture(scope="module")
def server(spent_hosts, smollm2):
    from skippy.stages.package import split_package
    package = spent_hosts[0].root / "smollm2-package"  # host 1's own: no other reads it
    split_package(smollm2, package)
    with serving(spent_hosts[0], PORT, "--package", str(package), "--stages", "3",
                 "--ctx", "8192", "--lanes", "10", "--wire", "f32",
                 "--weight-format", "int4", log="recut.log") as log:
        yield log


def _status(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/status.json", timeout=60) as r:
        return json.loads(r.read())


def test_a_lost_host_whose_layers_fit_nowhere_cuts_the_model_anew(hosts, server, smollm2):
    head, kept, lost = hosts
    stages = planned(server.read_text())
    nodes = ray_nodes(f"{head.ip}:{RAY_PORT}")
    # a stage on each host (which on which is the planner's: it weighs the links it
    # measured, and on a loaded machine they can outweigh the memories' order)
    assert sorted(node for *_, node in stages) == sorted(nodes[h.ip][:12] for h in hosts)
    want = fault_free(smollm2, [(0, 30)], QUESTIONS)
    base = f"http://{head.ip}:{PORT}"
    before = _status(base)["topology"]

    fetched = len(fetch_lines(kept))
    assert fetched >= 1  # its stage's parts, from host 1
    streams = Streams(base, QUESTIONS, MAX_TOKENS)
    streams.start(chunks=2)
    t = time.monotonic()
    kill_host(lost)
    streams.join()
    recovery = time.monotonic() - t
    assert not streams.errors, streams.errors
    assert streams.got == want, server.read_text()[-3000:]

    text = server.read_text()
    (n, digest, was), = CUT_LINE.findall(text)
    assert n == "2" and before.startswith(was) and not before.startswith(digest)
    status = _status(base)
    assert status["topology"].startswith(digest)
    rows = status["plan"]["stages"]
    assert len(rows) == 2 and rows[0]["layers"][0] == 0 and rows[-1]["layers"][1] == 30
    assert rows[0]["layers"][1] == rows[1]["layers"][0], rows
    assert {r["node"] for r in rows} == {nodes[h.ip][:12] for h in (head, kept)}, rows
    assert len(fetch_lines(kept)) > fetched  # the parts of its new layers, from host 1
    print(f"\nhost 3 killed under 4 streams: the model cut anew into 2 stages, all 4 "
          f"streams done {recovery:.1f} s after the kill")
