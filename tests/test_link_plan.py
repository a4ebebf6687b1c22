"""A plan over hosts whose links differ, on hosts that really are separate
(tests/hosts.py): host 2 is 20 ms from the others (the transport's host test hook,
`SKIPPY_TEST_HOST_DELAY_MS`: each message between two hosts waits both hosts' delays at
its sender, and serve's link probe measures them too; this kernel has no netem). The
model needs two hosts (10 lanes of 8,192 tokens), and by memory alone its stages would go
to hosts 1 and 2, the largest; serve measures the links and plans them on hosts 1 and 3,
and a token costs less there than on the 3-stage plan that crosses host 2's link. Prints
both per-token times (evals/README.md quotes them).

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from hosts import RAY_PORT, planned, ray_nodes, serving  # noqa: E402
from skippy.mesh.stage.channels import HOST_DELAY_ENV  # noqa: E402
from test_hop_latency import _stream  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8020
FAR_MS = 20


def test_the_plan_keeps_off_the_far_host_and_a_token_costs_least_there(hosts, smollm2,
                                                                         monkeypatch):
    head, far, near = hosts
    monkeypatch.setenv(HOST_DELAY_ENV, f"{far.ip}={FAR_MS}")  # the stages inherit it
    nodes = ray_nodes(f"{head.ip}:{RAY_PORT}")
    runs = {}
    for i, stages in enumerate(((), ("--stages", "3"))):
        with serving(head, PORT + i, "--model", str(smollm2), *stages, "--ctx", "8192",
                     "--lanes", "10", "--weight-format", "int4", "--speculate", "off",
                     log=f"serve-links-{i}.log") as log:
            text, ms = _stream(f"http://{head.ip}:{PORT + i}")
            runs[len(stages)] = ([node for *_, node in planned(log.read_text())], text, ms)
    (chosen, text, ms), (forced, text3, ms3) = runs[0], runs[2]
    print(f"\nhost 2 {FAR_MS} ms away: the plan's 2 stages on hosts 1 and 3, "
          f"{ms:.1f} ms/token; 3 stages across host 2, {ms3:.1f} ms/token")
    assert chosen == [nodes[head.ip][:12], nodes[near.ip][:12]]
    assert nodes[far.ip][:12] in forced
    assert text and text3  # (two cuts on the f16 wire: their texts may differ)
    assert ms < ms3
