"""A worker host lost while serving, on hosts that really are separate (tests/hosts.py):
`skippy serve` on host 1 with stage 0 there and stage 1 on host 2, and host 3 joining the
cluster after the start; host 2's Ray node is killed (every process in its namespace,
SIGKILL) under 4 greedy streams. Stage 1 moves, with the same layers, to host 3 (the
topology digest stays), where it listens on host 3's own address over the cluster's TLS;
every stream finishes with the fault-free text, and /ready says 503 while no pipeline can
serve.

tests/test_node_loss.py checks the same on Ray nodes that share one network namespace.
Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

from hosts import (MEMORY, RAY_PORT, Streams, join_ray, kill_host,  # noqa: E402
                   leave_ray, planned, probe_stage, ray_nodes, serving, stage_address)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The `hosts` fixture (tests/conftest.py) ranks them by memory: stage 0 on host 1, stage
# 1 on host 2. Once host 2 is gone, host 3 (2.8 GiB free) has more memory left than host 1
# (3.0 GiB less stage 0's ~0.75 GiB), so the engine moves stage 1 there.
PORT = 8000
CTX = 1024
MAX_TOKENS = 24
LANES = 5  # the 4 streams, and one for the gateway's readiness probe
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Why is the sky blue?", "Write a haiku about rivers."]
PLAN_LINE = re.compile(r"plan: .* topology (\w+)")
MOVE_LINE = re.compile(r"pipeline 0 stage (\d+): node (\w+) is lost; layers (\d+)-(\d+) "
                       r"move to node (\w+) \(same split, topology (\w+)\)")


@pytest.fixture(scope="module")
def server(spent_hosts, smollm2):
    """`skippy serve` inside host 1, two stages, started while host 3 is out of the
    cluster; host 3 joins once the gateway answers. Yields (the log's path, host 3's node
    id). The test kills host 2: the hosts end with this module."""
    head, _, late = spent_hosts
    leave_ray(late, head)
    with serving(head, PORT, "--model", str(smollm2), "--stages", "2", "--ctx", str(CTX),
                 "--lanes", str(LANES), "--weight-format", "int4") as log:
        yield log, join_ray(late, head, MEMORY[2])


def fault_free(model, ranges, questions) -> list[str]:
    """Each question's greedy answer from the in-process pipeline on the same layer
    ranges (int4 weights, cache off): the text every stream must give despite the fault."""
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.chat import render_chat
    from skippy.mesh.tokenizer import Tokenizer
    tok = Tokenizer(model)
    local = InProcessEngine(model, ranges=list(ranges), n_ctx=CTX, weight_format="int4",
                            cache=CacheConfig(enabled=False))
    out = []
    for q in questions:
        prompt = tok.encode(render_chat(model, [{"role": "user", "content": q}]))
        steps = local.complete(prompt, MAX_TOKENS, stop_ids=frozenset(tok.eog_ids))
        out.append(tok.decode([s.token for s in steps]))
    return out


class ReadyWatch(threading.Thread):
    """Polls /ready until stopped; keeps the status codes it saw, and when the last 503
    was answered (the pipeline whole again soon after)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.seen, self.done = url, [], threading.Event()
        self.last_down = 0.0

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=30) as r:
                    self.seen.append(r.status)
            except urllib.error.HTTPError as e:
                self.seen.append(e.code)
            except OSError:
                self.seen.append(0)
            if self.seen[-1] == 503:
                self.last_down = time.monotonic()
            self.done.wait(0.2)


def test_a_lost_host_moves_its_stage_and_every_stream_keeps_its_answer(
        hosts, server, smollm2):
    head, lost, spare = hosts
    server, spare_node = server
    text = server.read_text()
    stages = planned(text)
    nodes = ray_nodes(f"{head.ip}:{RAY_PORT}")
    assert [node for *_, node in stages] == [nodes[h.ip][:12] for h in (head, lost)], text
    want = fault_free(smollm2, [(a, b) for a, b, _ in stages], QUESTIONS)

    base = f"http://{head.ip}:{PORT}"
    streams = Streams(base, QUESTIONS, MAX_TOKENS)
    streams.start(chunks=2)
    assert all(r.is_alive() for r in streams.runs), (streams.chunks, streams.errors)

    watch = ReadyWatch(f"{base}/ready")
    t = time.monotonic()
    kill_host(lost)
    watch.start()
    streams.join()
    recovery = time.monotonic() - t
    assert not streams.errors, streams.errors
    assert streams.got == want, server.read_text()[-3000:]

    # /ready: 503 while the chain was broken, 200 again once it is whole
    deadline = time.monotonic() + 30
    while not watch.seen or watch.seen[-1] != 200:
        assert time.monotonic() < deadline, watch.seen
        time.sleep(0.2)
    watch.done.set()
    watch.join(60)
    assert 503 in watch.seen and watch.seen[-1] == 200, watch.seen

    text = server.read_text()
    now = ray_nodes(f"{head.ip}:{RAY_PORT}")
    assert lost.ip not in now
    (stage, was, first, last, to, digest), = MOVE_LINE.findall(text)
    assert spare_node not in text.split(MOVE_LINE.search(text)[0])[0]  # it joined later
    assert (stage, was, to) == ("1", nodes[lost.ip][:12], spare_node[:12]), text
    # the stage made there listens on that node's address, over the cluster's TLS
    address = stage_address(spare)
    assert address.rsplit(":", 1)[0] == spare.ip
    assert probe_stage(head, address, "not the cluster's secret") == {
        "plain": "UNAVAILABLE", "other_ca": "UNAVAILABLE"}
    assert (int(first), int(last) + 1) == stages[1][:2]     # the same layers
    assert digest == PLAN_LINE.search(text)[1]             # so the same topology digest
    print(f"\nhost 2 killed under 4 streams: /ready 503 until {watch.last_down - t:.1f} s, "
          f"all 4 streams done {recovery:.1f} s after the kill")
