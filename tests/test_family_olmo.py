"""OLMo (v1) on a synthetic GGUF: LayerNorms with neither weight nor bias (mean
subtracted) before attention, FFN and head, Q/K/V clamped to [-c, c], no biases."""

from __future__ import annotations

import pytest
import torch

from dense_family_checks import (check_lanes_independent, check_matrix_makes_this_file,
                                 check_resume_is_bitwise_cold, runtime)
from family_checks import check_agreement, check_certify
from skippy.stages.norms import layer_norm
from skippy.stages.synth import OLMO_CLAMP_KQV, write_synthetic
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def olmo_f32(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "olmo-L4.gguf"
    return write_synthetic("olmo", layers=LAYERS, seed=7, out=out, tokenizer_from=smollm2)


def test_file_has_no_norm_weights_and_config_reads_clamp_and_eps(olmo_f32):
    f = GGUFFile(olmo_f32)
    assert not [n for n in f.tensors if "norm" in n]
    cfg = ModelConfig.from_gguf(f)
    f.close()
    assert cfg.clamp_kqv == OLMO_CLAMP_KQV
    assert cfg.rms_eps == pytest.approx(1e-5)  # from attention.layer_norm_epsilon


def test_layer_norm_is_mean_subtracted_and_row_local():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)) * 3 + 1
    got = layer_norm(x, 1e-5)
    d = x.double()
    want = (d - d.mean(-1, keepdim=True)) / torch.sqrt(d.var(-1, unbiased=False,
                                                            keepdim=True) + 1e-5)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.equal(layer_norm(x[2:3], 1e-5), got[2:3])


def test_q_k_v_are_clamped(olmo_f32):
    rt = runtime(olmo_f32)
    qkv = rt.layers[0].mixer.qkv
    h = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * 4
    raw, y = qkv.linear(h), qkv(h)
    assert raw.abs().max() > OLMO_CLAMP_KQV and y.abs().max() == OLMO_CLAMP_KQV
    assert torch.equal(y, raw.clamp(-OLMO_CLAMP_KQV, OLMO_CLAMP_KQV))


def test_follows_llama_cpp_teacher_forced(olmo_f32):
    check_agreement(olmo_f32, "olmo")


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_certify_two_stages(olmo_f32, fmt):
    check_certify(olmo_f32, 2, fmt)


def test_decode_lanes_are_independent_and_resume_is_bitwise(olmo_f32):
    check_lanes_independent(olmo_f32, "int8")
    check_resume_is_bitwise_cold(olmo_f32)


def test_certify_matrix_runs_this_file(olmo_f32, tmp_path):
    check_matrix_makes_this_file("olmo", olmo_f32, tmp_path)
