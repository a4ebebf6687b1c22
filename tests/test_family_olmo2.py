"""OLMo 2 on a synthetic GGUF: no pre-norms, RMSNorms over the whole Q and K projections
(not per head), then over the attention and FFN outputs."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file, runtime
from skippy.stages.layers import rms_norm
from skippy.topology.gguf_file import GGUFFile

LAYERS = 4


@pytest.fixture(scope="module")
def olmo2_f32(smollm2, tmp_path_factory):
    return case_file("olmo2", tmp_path_factory)


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
