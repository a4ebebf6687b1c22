"""State shared between hosts that really are separate (tests/hosts.py): a conversation
served by pipeline A on host 1 continues on pipeline B on host 2, whose stage pulls the
state from host 1 over the stage network (mutual TLS) instead of recomputing it, and
answers bitwise as a recompute does; and when host 2's stage is killed mid-conversation,
the rebuilt turn answers bitwise too. The driver is `evals/bench_cluster.py` itself, run
inside host 1, so the figures in its JSON (and its plot) are the eval's.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from hosts import RAY_PORT, ray_nodes  # noqa: E402
from skippy.mesh.stage.node_store import node_store_root  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The `hosts` fixture (tests/conftest.py): pipeline A goes where the plan puts stage 0
# (the largest host), B and C to the hosts with the most memory left after it.
DATA = Path(os.environ.get("SKIPPY_CORPUS", Path(__file__).resolve().parents[1].parent
                          / "shared" / "data" / "usecases.jsonl"))
TOKENS = 512


def test_turn_two_on_another_host_pulls_the_state_and_answers_bitwise(hosts, smollm2):
    if not DATA.is_file():
        pytest.skip(f"no corpus at {DATA}")
    head = hosts[0]
    out = head.root / "bench_cluster.json"
    done = head.run(sys.executable, "-m", "skippy.evals.bench_cluster", "--model", str(smollm2),
                    "--tokens", str(TOKENS), "--sessions", "6", "--shared", "256",
                    "--address", f"{head.ip}:{RAY_PORT}",
                    "--data", str(DATA), "--json", str(out), timeout=480)
    print(done.stdout)
    result = json.loads(out.read_text())
    nodes = ray_nodes(f"{head.ip}:{RAY_PORT}")
    assert result["nodes"] == [[nodes[h.ip]] for h in hosts]  # a pipeline per host
    assert result["stage_tls"]
    row, = result["rows"]
    assert row["exact"]                                   # tokens and logits, every step
    assert row["pulled_tokens"] == TOKENS                 # turn 1 came from host 1
    assert row["remote_cached_tokens"] >= TOKENS and row["local_cached_tokens"] >= TOKENS
    assert 0 < row["fetched_bytes"]
    assert out.with_suffix(".png").stat().st_size > 0
    # Faults: host 2's stage killed mid-conversation; the rebuilt turn answers bitwise
    faults = result["faults"]
    assert faults["exact"] and faults["rebuilds"]["fault"] >= 1
    assert [t["fault"] for t in faults["turns"]] == [False, False, True, False]
    # Dedupe: 6 sessions sharing 512 tokens round-robin over the hosts; the first one on
    # each host computes or pulls the prefix, every later one finds it on its host
    sessions = result["dedupe"]["sessions"]
    a, b, _ = (result["state_by_node"][nodes[h.ip][:12]] for h in hosts)
    assert a["exports"] >= 1 and a["fetched_bytes"] == 0        # host 1 gave
    assert b["pulls"] >= 1 and b["fetched_bytes"] == row["fetched_bytes"] + sum(
        s["fetched_bytes"] for s in sessions if s["pipeline"] == 1)  # host 2 took
    assert all(s["cached_tokens"] >= 256 for s in sessions[1:])
    assert all(s["fetched_bytes"] == 0 for s in sessions[3:])
    assert sessions[2]["fetched_bytes"] > 0                   # host 3 had nothing
    for n in result["dedupe"]["nodes"].values():
        assert n["physical_bytes"] <= n["logical_bytes"]
    for h in hosts[:2]:  # the stages closed: nothing of theirs is left in the nodes' RAM
        assert not list((node_store_root(h.ip) / "blocks").iterdir())
