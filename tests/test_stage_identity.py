"""A stage's cache identity carries everything that changes its bits: the split it belongs
to (frames depend on where the stages before it cut) and the CPU kind torch computes on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from skippy.cache.config import CacheConfig
from skippy.cache.identity import prefix_digest
from skippy.mesh.control.local import InProcessEngine
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageSpec
from skippy.stages.stage_cache import StageCache
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.planner import gguf_model_digest, topology_digest


def _digest(path) -> str:
    f = GGUFFile(path)
    try:
        return gguf_model_digest(f)
    finally:
        f.close()


def test_the_served_stages_are_keyed_by_their_split(qwen3_f32):
    engine = InProcessEngine(qwen3_f32, ranges=[(0, 2), (2, 4), (4, 6)])
    try:
        keys = [s.cache.key for s in engine.servers]
        assert engine.info.topology_digest
        assert all(k.topology_digest == engine.info.topology_digest for k in keys)
    finally:
        asyncio.run(engine.close())


def test_splits_whose_upstream_cuts_differ_never_share_a_stages_state(qwen3_f32):
    """The last stage holds layers 4..6 in both splits, but its input frames were rounded
    at different cuts: its keys (and so every prefix digest under them) differ; the same
    split keys the same."""
    model = _digest(qwen3_f32)
    splits = {"a": [(0, 2), (2, 4), (4, 6)], "b": [(0, 3), (3, 4), (4, 6)]}
    keys = {}
    for name, ranges in list(splits.items()) + [("a again", splits["a"])]:
        spec = StageSpec(str(qwen3_f32), 4, 6, 2, 3, "f16",
                         topology_digest=topology_digest(model, ranges, "f16"))
        runtime = make_runtime(spec)
        keys[name] = StageCache(runtime, CacheConfig(), policy="ResidentKv").key
    assert keys["a"] == keys["a again"]
    assert keys["a"].digest != keys["b"].digest
    tokens = list(range(1, 65))
    assert prefix_digest(keys["a"], tokens) != prefix_digest(keys["b"], tokens)


_KEY_ON_CPU = """
import sys
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageSpec
from skippy.stages.stage_cache import stage_key_for
runtime = make_runtime(StageSpec(sys.argv[1], 0, 6, 0, 1, "f16"))
print(dict(runtime.identity()["numeric_policy"])["cpu"], stage_key_for(runtime).digest.hex())
"""


def test_a_stage_on_another_cpu_kind_has_another_key(qwen3_f32):
    """AVX2-only and AVX-512 machines compute different bits in torch: ATEN_CPU_CAPABILITY
    makes this machine dispatch as an AVX2 one would."""
    def key(env):
        out = subprocess.run([sys.executable, "-c", _KEY_ON_CPU, str(qwen3_f32)],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             check=True, timeout=300)
        return out.stdout.split()
    native = key({"ATEN_CPU_CAPABILITY": "default"})
    avx2 = key({"ATEN_CPU_CAPABILITY": "avx2"})
    assert native[0] == "DEFAULT" and avx2[0] == "AVX2"
    assert native[1] != avx2[1]
    # the capability is read, not assumed: the same kind twice keys the same
    assert key({"ATEN_CPU_CAPABILITY": "avx2"}) == avx2
