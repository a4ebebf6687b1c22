"""`skippy drain` of a host under 4 streams, on hosts that really are separate
(tests/hosts.py): `skippy serve` on host 1 with stage 0 there and stage 1 on host 2;
while 4 greedy streams run, `skippy drain <host 2's node>` has the gateway place a copy
of the pipeline on hosts 1 and 3 (the same ranges: the same answers) and retire the old
one once its streams end. No stream fails, each gives its fault-free text, host 2 holds
no stage after, and a request after the drain answers from the new pipeline. And a
rolling restart: hosts 2 and 3 in turn drained, their Ray stopped and started again, while
rounds of streams run; every answer fault-free.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import pytest

pytest.importorskip("ray")

from hosts import MEMORY, RAY_PORT, Streams, join_ray, leave_ray, planned, ray_nodes, \
    serving  # noqa: E402
from skippy_cli import COMMAND  # noqa: E402
from test_host_loss import CTX, LANES, MAX_TOKENS, QUESTIONS, fault_free  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8001


def test_a_drained_host_gives_up_its_stage_and_every_stream_keeps_its_answer(
        hosts, smollm2):
    head, drained, _ = hosts
    with serving(head, PORT, "--model", str(smollm2), "--stages", "2", "--ctx", str(CTX),
                 "--lanes", str(LANES), "--weight-format", "int4", "--speculate", "off",
                 log="drain.log") as log:
        stages = planned(log.read_text())
        node = ray_nodes(f"{head.ip}:{RAY_PORT}")[drained.ip]
        assert stages[1][2] == node[:12], log.read_text()
        want = fault_free(smollm2, [(a, b) for a, b, _ in stages], QUESTIONS)
        base = f"http://{head.ip}:{PORT}"
        streams = Streams(base, QUESTIONS, MAX_TOKENS)
        streams.start(chunks=1)
        t = time.monotonic()
        drain = subprocess.run([*COMMAND, "drain", node[:12], "--url", base],
                               capture_output=True, text=True, timeout=600)
        took = time.monotonic() - t
        streams.join()
        assert drain.returncode == 0, drain.stderr + log.read_text()[-3000:]
        assert "pipeline 0 -> 1" in drain.stderr, drain.stderr
        assert not streams.errors, streams.errors
        assert streams.got == want, log.read_text()[-3000:]

        plan = _plan(base)
        assert {row["pipeline"] for row in plan} == {1}, plan
        assert node[:12] not in {row["node"] for row in plan}, plan
        again = streams.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=MAX_TOKENS, temperature=0)
        assert again.choices[0].message.content == want[0]
        print(f"\nhost 2 drained under 4 streams in {took:.1f} s: "
              f"{drain.stderr.strip().splitlines()[-1]}")


class Rounds(threading.Thread):
    """Rounds of the 4 greedy streams, each in a cache namespace of its own (so every one
    is computed by the stages), until stopped; keeps each round's errors and texts."""

    def __init__(self, base: str, want: list[str]):
        super().__init__(daemon=True)
        self.base, self.want = base, want
        self.done, self.count, self.wrong = threading.Event(), 0, []

    def run(self) -> None:
        while not self.done.is_set():
            streams = Streams(self.base, QUESTIONS, MAX_TOKENS, salt=f"rolling-{self.count}")
            streams.start(chunks=0)
            streams.join()
            if streams.errors or streams.got != self.want:
                self.wrong.append((self.count, streams.errors, streams.got))
            self.count += 1


def test_a_rolling_restart_of_the_worker_hosts_keeps_serving(hosts, smollm2):
    """Each worker host in turn: `skippy drain` it, its Ray stops (as a machine shut down
    does) and starts again as a new node; streams run throughout and every one gives its
    fault-free text. The head (Ray's head and the gateway) is not restarted."""
    head, second, third = hosts
    with serving(head, PORT, "--model", str(smollm2), "--stages", "2", "--ctx", str(CTX),
                 "--lanes", str(LANES), "--weight-format", "int4",
                 log="rolling.log") as log:
        stages = planned(log.read_text())
        want = fault_free(smollm2, [(a, b) for a, b, _ in stages], QUESTIONS)
        base = f"http://{head.ip}:{PORT}"
        rounds = Rounds(base, want)
        rounds.start()
        for n, host in enumerate((second, third)):
            node = ray_nodes(f"{head.ip}:{RAY_PORT}")[host.ip]
            drain = subprocess.run([*COMMAND, "drain", node[:12], "--url", base],
                                   capture_output=True, text=True, timeout=600)
            assert drain.returncode == 0, drain.stderr + log.read_text()[-3000:]
            assert node[:12] not in {row["node"] for row in _plan(base)}
            leave_ray(host, head)
            join_ray(host, head, MEMORY[1 + n])
            seen = rounds.count
            while rounds.count < seen + 2 and rounds.is_alive():  # rounds on the new plan
                time.sleep(0.1)
        rounds.done.set()
        rounds.join(240)
        assert not rounds.wrong, rounds.wrong[:2]
        assert rounds.count >= 4, rounds.count
        print(f"\nhosts 2 and 3 drained and restarted in turn: {rounds.count} rounds of 4 "
              f"streams, every answer fault-free")


def _plan(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=60) as r:
        return json.loads(r.read())["plan"]["stages"]
