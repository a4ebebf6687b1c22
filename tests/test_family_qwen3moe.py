"""qwen3moe: qwen3 attention with a mixture of experts in every layer (stages/moe.py),
through the family bar and the MoE exactness checks (tests/moe_checks.py)."""

from __future__ import annotations

import pytest

from family_checks import check_agreement, check_certify
from moe_checks import (check_lanes_alone_equal_together, check_padding_rows_not_routed,
                        check_threads_do_not_change_bits, whole)


@pytest.fixture(scope="module")
def qwen3moe_f32(smollm2, tmp_path_factory):
    """A 4-layer random-weight qwen3moe: 8 experts of width 128, 2 used per token."""
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "qwen3moe-L4.gguf"
    return write_synthetic("qwen3moe", layers=4, seed=7, out=out, tokenizer_from=smollm2)


def test_follows_llama_cpp_teacher_forced(qwen3moe_f32):
    check_agreement(qwen3moe_f32, "qwen3moe")


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_certify_two_stages(qwen3moe_f32, fmt):
    check_certify(qwen3moe_f32, 2, fmt)


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


def test_certify_matrix_synthesizes_this_model(qwen3moe_f32, tmp_path):
    from skippy.evals import certify_matrix as matrix
    made = matrix.model_path("qwen3moe", synth_dir=tmp_path)
    assert made.read_bytes() == qwen3moe_f32.read_bytes()


def test_integer_formats_do_not_depend_on_threads(qwen3moe_f32):
    check_threads_do_not_change_bits(qwen3moe_f32, "int4")
