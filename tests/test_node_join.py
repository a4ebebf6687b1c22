"""A node that joins under streams is used, on hosts that really are separate
(tests/hosts.py): `skippy serve --max-pipelines 2` on host 1, stage 0 there and stage 1
on host 2, started while host 3 is out of the cluster. Host 3 joins while greedy streams
run (each round in a cache namespace of its own, so every stream is computed); the
gateway places a second copy of the pipeline where it fits, host 3 holding a stage of it
(the same plan: the same answers), and every stream, before, during and after, gives its
fault-free text. Host 3 is a Ray node again at the end, as it was.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

pytest.importorskip("ray")

from hosts import MEMORY, RAY_PORT, Streams, join_ray, leave_ray, planned, ray_nodes, \
    serving  # noqa: E402
from test_host_loss import CTX, LANES, MAX_TOKENS, QUESTIONS, fault_free  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8003


def _plan(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=60) as r:
        return json.loads(r.read())["plan"]["stages"]


def test_a_node_that_joins_under_streams_gets_a_pipeline_and_every_answer_stays(
        hosts, smollm2):
    head, _, late = hosts
    leave_ray(late, head)
    joined: list[str] = []
    try:
        with serving(head, PORT, "--model", str(smollm2), "--stages", "2", "--ctx", str(CTX),
                     "--lanes", str(LANES), "--weight-format", "int4",
                     "--max-pipelines", "2", log="join.log") as log:
            stages = planned(log.read_text())
            want = fault_free(smollm2, [(a, b) for a, b, _ in stages], QUESTIONS)
            base = f"http://{head.ip}:{PORT}"
            joiner = threading.Thread(target=lambda: joined.append(
                join_ray(late, head, MEMORY[2])))
            rounds, deadline = 0, time.monotonic() + 240
            while True:  # rounds of 4 streams until one ran wholly after the copy was up
                grown = {row["pipeline"] for row in _plan(base)} == {0, 1}
                streams = Streams(base, QUESTIONS, MAX_TOKENS, salt=f"round-{rounds}")
                streams.start(chunks=1)
                if rounds == 0:
                    joiner.start()  # host 3 joins while the first streams run
                streams.join()
                rounds += 1
                assert not streams.errors, streams.errors
                assert streams.got == want, (rounds, log.read_text()[-3000:])
                if grown:
                    break
                assert time.monotonic() < deadline, log.read_text()[-3000:]
            joiner.join(60)
            text = log.read_text()
            assert "a node joined: pipeline 1 added" in text, text[-3000:]
            node = ray_nodes(f"{head.ip}:{RAY_PORT}")[late.ip]
            plan = _plan(base)
            assert node[:12] in {row["node"] for row in plan if row["pipeline"] == 1}, plan
            print(f"\nhost 3 joined under streams: pipeline 1 on "
                  f"{[row['node'] for row in plan if row['pipeline'] == 1]}, "
                  f"{rounds} rounds of 4 streams, every answer fault-free")
    finally:
        if not joined and late.ip not in ray_nodes(f"{head.ip}:{RAY_PORT}"):
            join_ray(late, head, MEMORY[2])  # the next modules share these hosts whole
