"""Llama 3 style rope frequency factors (rope_freqs.weight) in the llama family, on a
synthetic file written with `--rope-freqs`: rope base 500000, one factor per rotated pair
dividing its angle, as ggml's rope divides it."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from family_checks import case_file, runtime
from skippy.stages.layers import Rope
from skippy.stages.runtime import StageSpec
from skippy.stages.synth import SynthError, write_synthetic
from skippy.stages.synth_dense import LLAMA3_ROPE, llama3_rope_factors
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def llama3_f32(smollm2, tmp_path_factory):
    return case_file("llama3", tmp_path_factory)


def test_file_has_the_factors_and_llama3_base(llama3_f32):
    f = GGUFFile(llama3_f32)
    cfg = ModelConfig.from_gguf(f)
    assert cfg.rope_base == 500000.0
    assert f.tensors["rope_freqs.weight"].shape == (cfg.rope_dim // 2,)
    f.close()
    factors = llama3_rope_factors(32)
    assert factors[0] == 1.0 and factors[-1] == LLAMA3_ROPE["factor"]
    assert (np.diff(factors) >= 0).all() and ((factors > 1) & (factors < 8)).any()


def test_only_llama_takes_rope_freqs(smollm2, tmp_path):
    with pytest.raises(SynthError, match="qwen3 has no knob rope_freqs"):
        write_synthetic("qwen3", layers=1, seed=0, out=tmp_path / "x.gguf",
                        tokenizer_from=smollm2, rope_freqs=True)


def test_every_stage_rotates_by_the_factors(llama3_f32):
    rt = runtime(llama3_f32)
    rope = rt.layers[0].mixer.rope
    factors = torch.from_numpy(llama3_rope_factors(32))
    assert torch.equal(rope.factors, factors)
    rope.ensure(300)
    step = torch.tensor(math.pow(500000.0, -2.0 / 64), dtype=torch.float32)
    theta = torch.tensor(299.0)
    for i in range(32):  # ggml: the running product theta, divided by the pair's factor
        assert rope.cos[299, i] == torch.cos(theta / factors[i])
        theta = theta * step
    plain = Rope(64, 500000.0, 1.0, "norm")
    plain.ensure(300)
    assert torch.equal(plain.cos[299, :4], rope.cos[299, :4])  # factor 1: unchanged
    assert not torch.equal(plain.cos[299, -4:], rope.cos[299, -4:])
    spec = StageSpec(str(llama3_f32), 2, LAYERS, stage_index=1, n_stages=2, n_ctx=512)
    later = TorchStageRuntime(spec).layers[0].mixer.rope  # a stage without the ends
    assert torch.equal(later.factors, factors)


def test_the_cli_writes_it(tmp_path, smollm2):
    out = tmp_path / "l3.gguf"
    r = subprocess.run([sys.executable, "-m", "skippy.mesh.cli", "models", "synth", "--arch",
                        "llama", "--rope-freqs", "--layers", "1", "--seed", "3", "--hidden",
                        "64", "--ff", "128", "--heads", "2", "--kv-heads", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    f = GGUFFile(out)
    assert f.arch_key("rope.freq_base") == 500000.0 and "rope_freqs.weight" in f.tensors
    f.close()
