"""qwen3moe: qwen3 attention with a mixture of experts in every layer (stages/moe.py),
through the family bar, plus the MoE block's own exactness: a lane's rows never depend
on the lanes beside it nor on padding rows."""

from __future__ import annotations

import pytest
import torch

from family_checks import check_agreement, check_certify
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime

PROMPT = [(i * 7919) % 40000 + 100 for i in range(90)]


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
    rt = TorchStageRuntime(StageSpec(str(qwen3moe_f32), 0, 4, n_ctx=256))
    assert rt.cfg.n_expert == 8 and rt.cfg.n_expert_used == 2 and rt.cfg.expert_ff == 128
    assert rt.cfg.expert_gating == "softmax" and rt.cfg.expert_weights_norm
    assert all(isinstance(layer.ffn, MoeFfn) for layer in rt.layers)
    assert all(len(layer.ffn.experts) == 8 for layer in rt.layers)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_lane_logits_alone_equal_beside_other_lanes(qwen3moe_f32, fmt):
    """Decode rows of 5 lanes in one step, each bitwise the lane's row decoded alone
    (fp32 pads the step to lane_batch rows; int4 runs it unpadded)."""
    rt = TorchStageRuntime(StageSpec(str(qwen3moe_f32), 0, 4, n_ctx=256, chunk=32,
                                     lane_batch=8, weight_format=fmt))
    lengths = [20 + 13 * k for k in range(5)]
    lanes = [rt.alloc_lane() for _ in lengths]
    for lane, n in zip(lanes, lengths):
        rt.prefill(lane, torch.tensor(PROMPT[:n]), logits="none")
    step = [torch.tensor(PROMPT[n]) for n in lengths]
    alone = []
    for lane, n, tok in zip(lanes, lengths, step):
        alone.append(rt.decode([(lane, tok)])[0].logits)
        rt.copy_lane(lane, lane, n)  # undo the step
    together = rt.decode(list(zip(lanes, step)))
    for k in range(len(lanes)):
        assert torch.equal(together[k].logits, alone[k]), f"{fmt}: lane {k}"


def test_padding_rows_are_not_routed(qwen3moe_f32):
    """A short last chunk: its real rows' logits do not depend on what its padding rows
    hold (the padding is zero rows in serving; here garbage after the first layer)."""
    from skippy.stages.moe import MoeFfn
    from skippy.stages.transformer import Segment
    rt = TorchStageRuntime(StageSpec(str(qwen3moe_f32), 0, 4, n_ctx=256, chunk=32))
    ffn = rt.layers[0].ffn
    assert isinstance(ffn, MoeFfn)
    h = torch.randn(32, rt.cfg.hidden, generator=torch.Generator().manual_seed(1))
    seg = Segment(None, 0, 32, 0, n_real=20)
    a = ffn(h, [seg])
    h2 = h.clone()
    h2[20:] = torch.randn(12, rt.cfg.hidden)
    b = ffn(h2, [seg])
    assert torch.equal(a[:20], b[:20])
    assert not a[20:].any()  # no shared experts: padding rows get nothing
