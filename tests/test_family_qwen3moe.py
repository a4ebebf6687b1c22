"""qwen3moe: qwen3 attention with a mixture of experts in every layer (stages/moe.py),
beside the family bar (tests/test_family_bar.py): the MoE exactness checks (tests/moe_checks.py)."""

from __future__ import annotations

import pytest

from family_checks import case_file
from moe_checks import (check_lanes_alone_equal_together, check_padding_rows_not_routed,
                        check_threads_do_not_change_bits, whole)


@pytest.fixture(scope="module")
def qwen3moe_f32(smollm2, tmp_path_factory):
    """A 4-layer random-weight qwen3moe: 8 experts of width 128, 2 used per token."""
    return case_file("qwen3moe", tmp_path_factory)


def test_every_layer_is_a_mixture_of_experts(qwen3moe_f32):
    from skippy.stages.moe import MoeFfn
    rt = whole(qwen3moe_f32)
    cfg = rt.cfg
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_ff) == (8, 2, 128)
    assert cfg.expert_gating == "softmax" and cfg.expert_weights_norm
    assert all(isinstance(layer.ffn, MoeFfn) and len(layer.ffn.experts) == 8
               for layer in rt.layers)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_lane_logits_alone_equal_beside_other_lanes(qwen3moe_f32, fmt):
    check_lanes_alone_equal_together(qwen3moe_f32, fmt)


def test_padding_rows_are_not_routed(qwen3moe_f32):
    check_padding_rows_not_routed(qwen3moe_f32)


def test_integer_formats_do_not_depend_on_threads(qwen3moe_f32):
    check_threads_do_not_change_bits(qwen3moe_f32, "int4")
