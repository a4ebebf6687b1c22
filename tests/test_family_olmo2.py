"""OLMo 2 on a synthetic GGUF: no pre-norms, RMSNorms over the whole Q and K projections
(not per head), then over the attention and FFN outputs."""

from __future__ import annotations

import pytest
import torch

from dense_family_checks import (check_lanes_independent, check_matrix_makes_this_file,
                                 check_resume_is_bitwise_cold, runtime)
from family_checks import check_agreement, check_certify
from skippy.stages.layers import rms_norm
from skippy.stages.synth import write_synthetic
from skippy.topology.gguf_file import GGUFFile

LAYERS = 4


@pytest.fixture(scope="module")
def olmo2_f32(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "olmo2-L4.gguf"
    return write_synthetic("olmo2", layers=LAYERS, seed=7, out=out, tokenizer_from=smollm2)


def test_file_has_whole_projection_qk_norms_and_no_pre_norms(olmo2_f32):
    f = GGUFFile(olmo2_f32)
    assert f.tensors["blk.0.attn_q_norm.weight"].shape == (256,)       # n_heads * head_dim
    assert f.tensors["blk.0.attn_k_norm.weight"].shape == (2 * 64,)    # n_kv_heads * head_dim
    assert "blk.0.attn_norm.weight" not in f.tensors and "blk.0.ffn_norm.weight" not in f.tensors
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(f.tensors)
    f.close()


def test_q_is_normed_over_all_heads_at_once(olmo2_f32):
    rt = runtime(olmo2_f32)
    layer = rt.layers[0]
    assert layer.attn_norm is None and layer.ffn_norm is None
    attn = layer.mixer
    assert attn.qk_norm is None  # nothing per head reaches the decode kernel
    h = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    y = attn.qkv(h)
    raw = attn.qkv.linear(h)
    want = rms_norm(raw[:, :256], attn.qkv.q_norm, rt.cfg.rms_eps)
    assert torch.equal(y[:, :256], want)
    per_head = rms_norm(raw[:, :256].view(3, 4, 64), attn.qkv.q_norm.view(4, 64), rt.cfg.rms_eps)
    assert not torch.allclose(y[:, :256], per_head.reshape(3, 256), atol=1e-3)
    assert torch.equal(y[:, 384:], raw[:, 384:])  # V untouched


def test_follows_llama_cpp_teacher_forced(olmo2_f32):
    check_agreement(olmo2_f32, "olmo2")


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_certify_two_stages(olmo2_f32, fmt):
    check_certify(olmo2_f32, 2, fmt)


def test_decode_lanes_are_independent_and_resume_is_bitwise(olmo2_f32):
    check_lanes_independent(olmo2_f32, "int8")
    check_resume_is_bitwise_cold(olmo2_f32)


def test_certify_matrix_runs_this_file(olmo2_f32, tmp_path):
    check_matrix_makes_this_file("olmo2", olmo2_f32, tmp_path)
