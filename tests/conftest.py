"""Shared fixtures: real models (pulled once per machine), derived files, the corpus."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "usecases.jsonl"

# Files of few tests that take 20 s or more (a cluster of hosts, a lost node, a corpus).
# `make test` hands files to its 2 workers most tests first (xdist's order, which pairs a
# heavy file with light ones), and so handed these out last: one worker was left with a
# 40 s file queued when the other had finished (70 s apart at the end, twice). Here the
# files of 3 tests or fewer go heavy ones first: the last ones handed out are light.
HEAVY_FEW = {"test_cluster_state.py", "test_host_loss.py", "test_node_loss.py",
             "test_part_delivery.py", "test_gateway_properties.py", "test_cache_exactness.py",
             "test_giant_proof.py", "test_numerics.py", "test_service.py"}


def pytest_collection_modifyitems(config, items):
    """The order above (with --no-loadscope-reorder, the Makefile's): files of 4 tests or
    more by their number of tests, most first; then the heavy few-test files; then the
    light ones; tests in a file in their own order."""
    if config.getoption("loadscopereorder", True):
        return
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path.name, i)
    hosts_tests = sum(count.get(name, 0) for name in HOSTS_FILES)
    def order(it):
        n, name = count[it.path.name], it.path.name
        if name in HOSTS_FILES:   # one unit of work, in HOSTS_FILES' order
            return (-hosts_tests, False, -hosts_tests, -1, HOSTS_FILES.index(name))
        return (-n if n > 3 else 0, name not in HEAVY_FEW, -n, first[name], 0)
    items.sort(key=order)


# The files that run on hosts of their own (tests/hosts.py) share one set of hosts, one
# file after the other: three Ray nodes take ~11 s to start and stop alone, ~20 s beside
# the other worker. test_host_loss kills a host and ends the set; test_host_recut, on a
# set of its own, kills one too; test_node_join (4 hosts) and test_ray_up (tests/ssh_hosts.py)
# make hosts of their own on the same bridge, so they run in the unit too.
HOSTS_FILES = ("test_separate_hosts.py", "test_hop_latency.py", "test_link_plan.py",
               "test_part_delivery.py", "test_cluster_state.py", "test_host_scaling.py",
               "test_drain.py",
               "test_host_loss.py", "test_host_recut.py", "test_node_join.py",
               "test_ray_up.py")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with HOSTS_FILES one unit: the worker that runs them keeps its
    hosts from one file to the next."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HostsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "hosts" if path.rsplit("/", 1)[-1] in HOSTS_FILES else path

    return HostsTogether(config, log)


@pytest.fixture(scope="module", autouse=True)
def _module_garbage():
    """A test file's engines go with it: one a fixture dropped without closing it sits in
    a reference cycle (its loop threads hold its stages) that Python's oldest-generation
    collection may not reach for many files, and a worker's heap grew by GBs over a run."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
    from skippy.mesh.models import pull
    return pull("smollm2")


@pytest.fixture(scope="session")
def smollm2_q4_0(smollm2):
    """SmolLM2 requantized to Q4_0: the blocks the int4 weight format keeps as they are."""
    from skippy.mesh.models import requantize
    return requantize(smollm2, "q4_0")


@pytest.fixture(scope="session")
def gemma3():
    from skippy.mesh.models import pull
    return pull("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_f16(smollm2):
    from skippy.mesh.models import requantize
    return requantize(smollm2, "f16")


@pytest.fixture(scope="session")
def gemma3_f16(gemma3):
    from skippy.mesh.models import requantize
    return requantize(gemma3, "f16")


@pytest.fixture(scope="session")
def qwen3_f32(smollm2, tmp_path_factory):
    """A 6-layer random-weight qwen3 in f32 (enough layers for a 5-stage split)."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "qwen3-L6.gguf"
    return write_synthetic("qwen3", layers=6, seed=7, out=out, tokenizer_from=smollm2)


@pytest.fixture(scope="session")
def qwen3_tools(smollm2, tmp_path_factory):
    """A 2-layer random-weight qwen3 whose chat template knows tools (Hermes/Qwen format,
    tests/data/hermes_tools.jinja): neither real model's template handles tools."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "qwen3-tools-L2.gguf"
    return write_synthetic("qwen3", layers=2, seed=11, out=out, tokenizer_from=smollm2,
                           chat_template=(REPO / "tests/data/hermes_tools.jinja").read_text())


@pytest.fixture(scope="session")
def qwen3_tools_url(qwen3_tools):
    """The gateway (real uvicorn on loopback) over qwen3_tools in 2 stages, served as
    "qwen3-tools" without cache: the tool-calling client tests share it. Needs a
    loopback-only network namespace, as every test that starts a server."""
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(qwen3_tools, 2, cache=CacheConfig(enabled=False),
                             model_name="qwen3-tools")
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        yield srv.url


@pytest.fixture(scope="session")
def corpus() -> list[dict]:
    """The use-case corpus; skipped where absent (a user's fresh clone), but CI sets
    SKIPPY_REQUIRE_CORPUS=1 so that a missing corpus fails there."""
    path = Path(os.environ.get("SKIPPY_CORPUS", DEFAULT_CORPUS))
    if not path.exists():
        if os.environ.get("SKIPPY_REQUIRE_CORPUS") == "1":
            pytest.fail(f"corpus not found at {path} (SKIPPY_REQUIRE_CORPUS=1)")
        pytest.skip(f"corpus not found at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def lfm2_f32(smollm2, tmp_path_factory):
    """A 6-layer random-weight LFM2 (short conv + attention) in f32."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "lfm2-L6.gguf"
    return write_synthetic("lfm2", layers=6, seed=3, out=out, tokenizer_from=smollm2)


@pytest.fixture(scope="session")
def falcon_h1_f32(smollm2, tmp_path_factory):
    """A 4-layer random-weight Falcon-H1 (Mamba2 and attention in parallel) in f32."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "falcon-h1-L4.gguf"
    return write_synthetic("falcon-h1", layers=4, seed=7, out=out, tokenizer_from=smollm2)


class _SharedHosts:
    """The hosts HOSTS_FILES share: made by the first module that asks, ended when the next
    test does not ask for them (or a module spent them, as test_host_loss does)."""
    stack: contextlib.ExitStack | None = None
    hosts: list | None = None

    @classmethod
    def get(cls, root_factory) -> list:
        if cls.hosts is None:
            from hosts import MEMORY, separate_hosts
            cls.stack = contextlib.ExitStack()
            cls.hosts = cls.stack.enter_context(
                separate_hosts(root_factory.mktemp("hosts"), MEMORY))
        return cls.hosts

    @classmethod
    def end(cls) -> None:
        if cls.stack is not None:
            stack, cls.stack, cls.hosts = cls.stack, None, None
            stack.close()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three hosts that really are separate (tests/hosts.py), shared by consecutive modules
    that ask for them; skips where they cannot be made (not root, not in a loopback-only
    namespace)."""
    return _SharedHosts.get(tmp_path_factory)


@pytest.fixture(scope="module")
def spent_hosts(hosts):
    """The hosts, for a module that breaks them (kills one): they end with the module."""
    yield hosts
    _SharedHosts.end()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Ends the shared hosts once the next test does not use them (or none is left), after
    the test's own fixtures (the servers on them) have ended."""
    yield
    if _SharedHosts.hosts is not None and (nextitem is None
                                           or "hosts" not in nextitem.fixturenames):
        _SharedHosts.end()
