"""The mesh across hosts that really are separate (tests/hosts.py): three network
namespaces on a bridge, each with its own address, Ray node and SKIPPY_HOME; `skippy
serve` on the first; the test a client on the bridge. One stage per host, mutual TLS
between them, the same answer as the in-process pipeline, and a stage port that a host
of the network without the cluster's certificate cannot call.

Runs inside the loopback-only namespace (DESIGN.md §9) as root; skips elsewhere."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

import openai  # noqa: E402

from hosts import (BIN, RAY_PORT, greedy_chat, planned, probe_stage,  # noqa: E402
                   ray_nodes, serving, stage_address)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8000
CTX = 1024
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def serve_log(hosts, smollm2):
    """`skippy serve` inside host 1, three stages, the gateway on host 1's address; the
    model by absolute path (host 1's SKIPPY_HOME is empty). Yields its log once it answers."""
    head = hosts[0]
    secret = head.root / "cluster-secret"
    secret.write_text("a secret the test knows, so that it can show it is not enough\n")
    secret.chmod(0o600)  # only its owner may read it
    with serving(head, PORT, "--model", str(smollm2), "--stages", "3",
                 "--cluster-secret-file", str(secret), "--ctx", str(CTX), "--lanes", "1",
                 "--weight-format", "int4") as log:
        yield log.read_text()


def test_hosts_see_only_their_own_address_and_files(hosts):
    first, second = hosts[0], hosts[1]
    addresses = second.run("ip", "-o", "-4", "addr", "show").stdout
    assert f"inet {second.ip}/24" in addresses and f"inet {first.ip}/" not in addresses
    assert "home" in first.run("ls", str(first.root)).stdout.split()
    assert second.run("ls", str(first.root)).stdout == ""   # an empty tmpfs covers it


def test_one_stage_per_host_each_on_its_own_address_with_tls(hosts, serve_log):
    nodes = ray_nodes(f"{hosts[0].ip}:{RAY_PORT}")
    stages = planned(serve_log)
    assert len(stages) == 3
    for h, (_, _, node) in zip(hosts, stages):
        assert nodes[h.ip].startswith(node), (h.ip, node, nodes)
        assert stage_address(h).rsplit(":", 1)[0] == h.ip
    assert "stage network: mutual TLS on each node address" in serve_log


def test_greedy_chat_matches_the_in_process_pipeline(hosts, serve_log, smollm2):
    got, want, tok = greedy_chat(f"http://{hosts[0].ip}:{PORT}/v1", smollm2,
                                 [(a, b) for a, b, _ in planned(serve_log)], QUESTION,
                                 n_ctx=CTX)
    assert want and tok.encode(got) == want and got == tok.decode(want)
    # the activations went host to host: stage 1 (host 2) holds a connection to stage 2
    assert stage_address(hosts[2]) in hosts[1].peers()


LINKS = """
import json, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from skippy.mesh.control.link_probe import _from_here, _rates
ray.init(address=sys.argv[1], logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
where = [(n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in alive]
asked = [_from_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
    n, soft=False)).remote([w for w in where if w[0] != n]) for n, _, _ in where]
ms = dict(zip([a for _, a, _ in where], ray.get(asked, timeout=60)))
rates = _rates({n: a for n, a, _ in where})
print(json.dumps({"ms": ms, "rates": list(rates.values())}))
"""


def test_each_host_times_its_links_to_the_others(hosts, serve_log):
    """The planner's link figures (mesh/control/link_probe.py): each host times TCP
    connects to the other hosts' raylets, and a burst to each other host's sink. These
    veth links are far under the 5 ms and far over the 100 MB/s the planner counts, so
    serve planned by memory (stage i on host i, above) and logged no failed probe."""
    assert "links between nodes not measured" not in serve_log
    out = hosts[0].run(str(BIN / "python"), "-c", LINKS, f"{hosts[0].ip}:{RAY_PORT}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    measured, rates = got["ms"], got["rates"]
    assert sorted(measured) == sorted(h.ip for h in hosts)
    for ms in measured.values():
        assert len(ms) == 2 and all(v is not None and 0 < v < 200 for v in ms.values()), ms
    assert len(rates) == 6 and all(r is not None and r > 0 for r in rates), rates
    print(f"\nveth bandwidths measured: {min(rates) / 1e6:.0f}-{max(rates) / 1e6:.0f} MB/s")


def test_a_host_without_the_cluster_certificate_cannot_call_a_stage(hosts, serve_log):
    address = stage_address(hosts[1])
    secret = (hosts[0].root / "cluster-secret").read_text()
    # the port is reachable from the other host (TCP connected): TLS is what refuses
    assert probe_stage(hosts[2], address, secret) == {"plain": "UNAVAILABLE",
                                                       "other_ca": "UNAVAILABLE"}


def test_a_model_file_only_one_host_has_is_served_there_alone(hosts, serve_log, smollm2):
    """A GGUF at a path only host 1 holds: the planner leaves out the hosts without it
    (and says so), rather than starting stages there that cannot open it."""
    import shutil
    head = hosts[0]
    own = head.root / "own.gguf"
    shutil.copyfile(smollm2, own)
    with serving(head, PORT + 1, "--model", str(own), "--stages", "2", "--ctx", str(CTX),
                 "--lanes", "1", "--weight-format", "int4", log="serve-own.log") as log:
        client = openai.OpenAI(base_url=f"http://{head.ip}:{PORT + 1}/v1", api_key="x",
                               max_retries=0, timeout=300)
        got = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=4, temperature=0)
        assert got.choices[0].message.content
        text = log.read_text()
    head_node = ray_nodes(f"{head.ip}:{RAY_PORT}")[head.ip]
    assert {node for _, _, node in planned(text)} == {head_node[:12]}, text
    assert text.count(f"has no {own}: no stage is placed there") == 2, text
