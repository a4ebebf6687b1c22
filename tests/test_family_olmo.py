"""OLMo (v1) on a synthetic GGUF: LayerNorms with neither weight nor bias (mean
subtracted) before attention, FFN and head, Q/K/V clamped to [-c, c], no biases."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file, runtime
from skippy.stages.norms import layer_norm
from skippy.stages.synth_dense import OLMO_CLAMP_KQV
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def olmo_f32(smollm2, tmp_path_factory):
    return case_file("olmo", tmp_path_factory)


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
