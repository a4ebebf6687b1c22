"""A node that joins under streams is used, on hosts that really are separate
(tests/hosts.py): a 3-host cluster serves `skippy serve --stages 3 --max-pipelines 2`,
each stage filling most of its host (10 lanes of 8,192 tokens); a 4th host, with room
for a whole copy, joins while greedy streams run (each round in a cache namespace of its
own, so every stream is computed). The gateway places a second pipeline on it (the same
plan: the same answers), every stream, before, during and after, gives its fault-free
text, the status page shows the new pipeline on host 4, and requests after the change
run there (its stages' CPU time grows).

Its own 4 hosts (the shared three end before it). Runs inside the loopback-only namespace
(DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")

from hosts import MEMORY, RAY_PORT, GiB, Streams, join_ray, leave_ray, planned, \
    ray_nodes, separate_hosts, serving  # noqa: E402
from test_host_loss import MAX_TOKENS, QUESTIONS, fault_free  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8003
BIG = int(6.5 * GiB)  # the joining host: three stages of the plan below fit


def _plan(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=60) as r:
        return json.loads(r.read())["plan"]["stages"]


def _stage_cpu_s(host) -> float:
    """CPU seconds the stage actors on `host` have used."""
    ticks = 0
    for pid in host.pids():
        try:
            if b"StageActor" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_a_fourth_host_that_joins_under_streams_gets_a_pipeline(tmp_path_factory, smollm2):
    # a short root: Ray's socket paths under it must fit 107 bytes
    with separate_hosts(tmp_path_factory.mktemp("j"), (*MEMORY, BIG)) as hosts:
        head, late = hosts[0], hosts[3]
        leave_ray(late, head)
        joined: list[str] = []
        with serving(head, PORT, "--model", str(smollm2), "--stages", "3", "--ctx", "8192",
                     "--lanes", "10", "--weight-format", "int4", "--max-pipelines", "2",
                     log="join.log") as log:
            stages = planned(log.read_text())
            nodes = ray_nodes(f"{head.ip}:{RAY_PORT}")
            assert [node for *_, node in stages] == [nodes[h.ip][:12] for h in hosts[:3]]
            want = fault_free(smollm2, [(a, b) for a, b, _ in stages], QUESTIONS)
            base = f"http://{head.ip}:{PORT}"
            joiner = threading.Thread(target=lambda: joined.append(
                join_ray(late, head, BIG)))
            rounds, deadline = 0, time.monotonic() + 240
            while True:  # rounds of 4 streams until one ran wholly after the copy was up
                grown = {row["pipeline"] for row in _plan(base)} == {0, 1}
                used = _stage_cpu_s(late)
                streams = Streams(base, QUESTIONS, MAX_TOKENS, salt=f"round-{rounds}")
                streams.start(chunks=1)
                if rounds == 0:
                    joiner.start()  # host 4 joins while the first streams run
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
            plan = _plan(base)
            assert {row["node"] for row in plan if row["pipeline"] == 1} \
                == {joined[0][:12]}, plan
            worked = _stage_cpu_s(late) - used
            assert worked > 0.2, worked  # the last round's requests ran there too
            print(f"\nhost 4 joined a 3-host cluster under streams: pipeline 1 on it, "
                  f"{rounds} rounds of 4 streams, every answer fault-free; its stages "
                  f"{worked:.1f} CPU s in the last round")
