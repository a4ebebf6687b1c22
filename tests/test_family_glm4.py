"""GLM-4 (dense) on a synthetic GGUF: biased Q/K/V stored fused (odd layers) or apart (even
layers), rope over the first half of each head, four norms per layer, and a fused gate-up
FFN (ffn_up holds the gate rows, then the up rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dense_family_checks import (check_lanes_independent, check_matrix_makes_this_file,
                                 check_resume_is_bitwise_cold, runtime)
from family_checks import check_agreement, check_certify
from skippy.stages.ffn import FusedUpFfn
from skippy.stages.synth import glm4_fused_qkv, write_synthetic
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def glm4_f32(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "glm4-L4.gguf"
    return write_synthetic("glm4", layers=LAYERS, seed=7, out=out, tokenizer_from=smollm2)


def test_file_stores_qkv_both_ways_and_a_double_width_up(glm4_f32):
    f = GGUFFile(glm4_f32)
    cfg = ModelConfig.from_gguf(f)
    assert [glm4_fused_qkv(i) for i in range(LAYERS)] == [False, True, False, True]
    assert "blk.1.attn_qkv.weight" in f.tensors and "blk.1.attn_q.weight" not in f.tensors
    assert "blk.0.attn_q.bias" in f.tensors and "blk.0.attn_qkv.weight" not in f.tensors
    assert f.tensors["blk.0.ffn_up.weight"].shape == (256, 2 * cfg.ff)  # ggml order
    assert "blk.0.ffn_gate.weight" not in f.tensors
    assert cfg.rope_dim == cfg.head_dim // 2
    f.close()


def test_both_qkv_layouts_carry_their_biases(glm4_f32):
    rt = runtime(glm4_f32)
    h = torch.zeros(1, 256)
    for layer in rt.layers[:2]:  # a zero row projects to the bias alone
        qkv = layer.mixer.qkv
        assert qkv.bias is not None and qkv.bias.numel() == 256 + 2 * 128
        assert torch.equal(qkv(h)[0], qkv.bias)


def test_fused_up_is_gate_then_up(glm4_f32):
    rt = runtime(glm4_f32)
    ffn = rt.layers[0].ffn
    assert isinstance(ffn, FusedUpFfn)
    h = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    both = ffn.gate_up(h)
    gate, up = both[:, :rt.cfg.ff], both[:, rt.cfg.ff:]
    assert torch.equal(ffn(h, []), ffn.down(F.silu(gate) * up))


def test_follows_llama_cpp_teacher_forced(glm4_f32):
    check_agreement(glm4_f32, "glm4")


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_certify_two_stages(glm4_f32, fmt):
    check_certify(glm4_f32, 2, fmt)


def test_decode_lanes_are_independent_and_resume_is_bitwise(glm4_f32):
    check_lanes_independent(glm4_f32, "int8")
    check_resume_is_bitwise_cold(glm4_f32)


def test_certify_matrix_runs_this_file(glm4_f32, tmp_path):
    check_matrix_makes_this_file("glm4", glm4_f32, tmp_path)
