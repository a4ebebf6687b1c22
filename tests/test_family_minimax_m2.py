"""minimax-m2: whole-projection Q/K norms, partial rope, and a mixture of experts chosen
by sigmoid scores plus a selection bias (exp_probs_b) that does not enter the weights;
beside the family bar (tests/test_family_bar.py): the MoE exactness checks (tests/moe_checks.py)."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file
from moe_checks import (check_lanes_alone_equal_together, check_padding_rows_not_routed,
                        check_threads_do_not_change_bits, whole)


@pytest.fixture(scope="module")
def minimax_m2_f32(smollm2, tmp_path_factory):
    """A 4-layer random-weight MiniMax-M2: 8 experts of width 128, 2 used per token, rope
    over half of each 64-wide head."""
    return case_file("minimax-m2", tmp_path_factory)


def test_config_as_llama_cpp_reads_it(minimax_m2_f32):
    rt = whole(minimax_m2_f32)
    cfg = rt.cfg
    assert cfg.expert_gating == "sigmoid" and cfg.expert_weights_norm
    assert (cfg.rope_dim, cfg.head_dim) == (32, 64)
    assert cfg.family.qk_norm_span == "projection"  # stages/qkv.py norms Q and K whole
    assert all(layer.mixer.qkv.q_norm is not None and layer.mixer.q_norm is None
               for layer in rt.layers)
    assert all(layer.ffn.bias is not None for layer in rt.layers)


def test_selection_bias_changes_the_choice_not_the_weights(minimax_m2_f32):
    ffn = whole(minimax_m2_f32).layers[0].ffn
    logits = torch.randn(200, ffn.router.out_features, generator=torch.Generator().manual_seed(0))
    experts, weights = ffn.routing(logits, ffn.bias)
    plain, _ = ffn.routing(logits)
    assert not torch.equal(experts, plain)  # the bias moves some choices
    probs = torch.sigmoid(logits).gather(1, experts)
    assert torch.allclose(weights, probs / probs.sum(1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_lane_logits_alone_equal_beside_other_lanes(minimax_m2_f32, fmt):
    check_lanes_alone_equal_together(minimax_m2_f32, fmt)


def test_padding_rows_are_not_routed(minimax_m2_f32):
    check_padding_rows_not_routed(minimax_m2_f32)


def test_integer_formats_do_not_depend_on_threads(minimax_m2_f32):
    check_threads_do_not_change_bits(minimax_m2_f32, "int4")
