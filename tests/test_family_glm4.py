"""GLM-4 (dense) on a synthetic GGUF: biased Q/K/V stored fused (odd layers) or apart (even
layers), rope over the first half of each head, four norms per layer, and a fused gate-up
FFN (ffn_up holds the gate rows, then the up rows)."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file, runtime
from skippy.stages.ffn import FusedUpFfn
from skippy.stages.layers import gated_activation
from skippy.stages.synth_dense import glm4_fused_qkv
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def glm4_f32(smollm2, tmp_path_factory):
    return case_file("glm4", tmp_path_factory)


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
    # the same activation kernel the FFN runs (its floats vs torch's: tests/test_qkernel.py),
    # so only the halves' order is checked: swapped halves give other values
    assert torch.equal(ffn(h, []), ffn.down(gated_activation(gate, up, "silu")))
    assert not torch.allclose(ffn(h, []), ffn.down(gated_activation(up, gate, "silu")))
