"""deepseek2 (DeepSeek-V2/V3/R1, GLM-4.7-Flash): multi-head latent attention with YaRN rope,
a leading dense layer, then DeepSeek-V3-style MoE layers (sigmoid routing with the
exp_probs_b selection bias, grouped, normalised and scaled weights, a shared expert);
beside the family bar (tests/test_family_bar.py): the MoE exactness checks
(tests/moe_checks.py), and the lane state MLA keeps: one latent row of kv_lora_rank + n_rot
floats per token and layer, never per-head K and V."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file
from moe_checks import (check_lanes_alone_equal_together, check_padding_rows_not_routed,
                        check_threads_do_not_change_bits)
from skippy.evals.numerics import family_agreement, whole_model
from skippy.stages.ffn import GatedFfn
from skippy.stages.moe import MoeFfn
from skippy.stages.runtime import LaneState, StageError
from skippy.stages.synth import SynthError, write_synthetic
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]
CHUNK = 32


@pytest.fixture(scope="module")
def deepseek2_f32(smollm2, tmp_path_factory):
    """4 layers of MLA (q low-rank path, absorbed attn_k_b / attn_v_b, YaRN): 1 dense FFN,
    then 3 MoE layers of 16 experts of width 128 (4 used, 2 of 4 groups) and a shared one."""
    return case_file("deepseek2", tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek2_lite_kv_b(smollm2, tmp_path_factory):
    """The other loader paths: queries from attn_q (no q low rank), the unsplit attn_kv_b,
    rope without scaling keys; every layer dense (no expert keys beyond those llama.cpp's
    loader requires)."""
    out = tmp_path_factory.mktemp("synth") / "deepseek2-lite-kvb.gguf"
    return write_synthetic("deepseek2", layers=2, seed=6, out=out, tokenizer_from=smollm2,
                           q_lora_rank=0, kv_b=1, yarn_factor=0, experts=0)


def test_direct_queries_and_unsplit_kv_b_follow_llama_cpp(deepseek2_lite_kv_b):
    r = family_agreement(deepseek2_lite_kv_b, n_prompts=1, length=128, steps=4)
    print(f"\ndeepseek2 attn_q + attn_kv_b: max |dlogit| {r['max_abs_delta']:.2e}")
    assert r["top1_where_clear"] and r["max_abs_delta"] <= 1e-3, r


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_lanes_decoded_together_equal_each_alone(deepseek2_f32, fmt):
    check_lanes_alone_equal_together(deepseek2_f32, fmt)


def test_padding_rows_are_not_routed(deepseek2_f32):
    check_padding_rows_not_routed(deepseek2_f32)


def test_threads_do_not_change_int4_bits(deepseek2_f32):
    check_threads_do_not_change_bits(deepseek2_f32, "int4")


def test_config_reads_the_mla_and_moe_keys(deepseek2_f32):
    cfg = ModelConfig.from_gguf(GGUFFile(deepseek2_f32))
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared, cfg.expert_ff) == (16, 4, 1, 128)
    assert (cfg.expert_gating, cfg.expert_weights_norm, cfg.expert_weights_scale) == \
        ("sigmoid", True, 2.5)
    assert (cfg.expert_groups, cfg.expert_groups_used, cfg.leading_dense_layers) == (4, 2, 1)
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.k_head, m.v_head, m.rope_dim) == (384, 128, 48, 32, 16)
    assert m.absorbed and m.rope.ext_factor == 1.0 and m.rope.freq_scale == 0.25
    assert m.rope.corr_dims(m.rope_dim) == (1.0, 5.0)  # a ramp across the rotated pairs
    # mscale 1 + 0.1 * 0.707 * ln 4, squared, over sqrt(48)
    assert m.kq_scale == pytest.approx((1 + 0.0707 * 1.3862944) ** 2 / 48 ** 0.5, rel=1e-6)


def test_exported_kv_is_one_latent_row_per_token_and_layer(deepseek2_f32):
    rt = whole_model(deepseek2_f32, chunk=CHUNK)
    m = rt.cfg.mla
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:70]), logits="none")
    state = rt.export_state(lane, 64)
    assert [tuple(k.shape) for k in state.keys] == [(64, 1, m.kv_lora_rank + m.rope_dim)] * LAYERS
    assert state.values == [] and state.fixed == {}
    assert state.nbytes == 64 * LAYERS * (m.kv_lora_rank + m.rope_dim) * 4
    assert "mla-latent" in rt.identity()["kv_layout"]


def test_a_per_head_kv_state_is_refused(deepseek2_f32):
    rt = whole_model(deepseek2_f32, chunk=CHUNK)
    lane = rt.alloc_lane()
    rows = torch.zeros(8, 1, rt.cfg.mla.kv_lora_rank)  # latent without its rope part
    with pytest.raises(StageError):
        rt.import_state(lane, LaneState(8, 8, [rows] * LAYERS, []))
    with pytest.raises(StageError):
        rt.import_state(lane, LaneState(8, 8, [rows] * LAYERS, [rows] * LAYERS))


def test_leading_dense_layer_then_moe_layers(deepseek2_f32):
    rt = whole_model(deepseek2_f32)
    kinds = [type(layer.ffn) for layer in rt.layers]
    assert kinds == [GatedFfn, MoeFfn, MoeFfn, MoeFfn]
    assert all(layer.ffn.bias is not None and layer.ffn.shared is not None
               for layer in rt.layers[1:])


def test_synth_options_are_the_archs_own(smollm2, tmp_path):
    with pytest.raises(SynthError, match="deepseek2 has no knob kv_lora "):
        write_synthetic("deepseek2", layers=1, seed=1, out=tmp_path / "a.gguf",
                        tokenizer_from=smollm2, kv_lora=64)
    with pytest.raises(SynthError, match="qwen3 has no knob kv_lora_rank"):
        write_synthetic("qwen3", layers=1, seed=1, out=tmp_path / "b.gguf",
                        tokenizer_from=smollm2, kv_lora_rank=64)
    assert not list(tmp_path.iterdir())
