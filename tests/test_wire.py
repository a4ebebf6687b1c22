"""Frames on the data plane: the proto codec, and whether the q8 wire keeps the answers."""

import numpy as np
import pytest
import torch

from skippy.mesh.wire import MalformedFrame, frame_from_proto, frame_to_proto
from skippy.proto import stage_pb2
from skippy.stages.frame import Frame, from_wire, to_wire


def gemma_sized_rows(n: int = 6, width: int = 640, seed: int = 0) -> torch.Tensor:
    """Random rows, NaN-free, two of them past f16's range like Gemma's BOS rows (~1e5)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, width, generator=g) * 50
    rows[0] *= 2e3
    rows[3, 7] = -1.2e5
    return rows


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def over_the_wire(frame: Frame) -> Frame:
    return frame_from_proto(stage_pb2.Frame.FromString(frame_to_proto(frame).SerializeToString()))


@pytest.mark.parametrize("wire", ["f32", "f16", "q8"])
def test_frames_round_trip_bitwise(wire):
    sent = to_wire(17, gemma_sized_rows(), wire)
    got = over_the_wire(sent)
    assert got.start == 17 and got.rows.dtype == sent.rows.dtype
    assert torch.equal(bits(got.rows), bits(sent.rows))
    assert (got.scale is None) == (sent.scale is None)
    if sent.scale is not None:
        assert torch.equal(bits(got.scale), bits(sent.scale))
    assert torch.equal(bits(from_wire(got)), bits(from_wire(sent)))


def test_f16_scale_path_is_exercised_and_in_range_frames_send_no_scales():
    big = to_wire(0, gemma_sized_rows(), "f16")
    assert (big.scale > 1).any()
    assert len(frame_to_proto(big).scales) == 4 * big.n_rows
    small = to_wire(0, torch.randn(3, 16), "f16")
    msg = frame_to_proto(small)
    assert msg.scales == b""
    assert torch.equal(over_the_wire(small).scale, small.scale)


def test_the_wire_is_little_endian_row_major():
    frame = to_wire(5, torch.arange(6, dtype=torch.float32).reshape(2, 3), "f32")
    msg = frame_to_proto(frame)
    assert (msg.dtype, msg.start, msg.rows, msg.width) == (stage_pb2.Frame.F32, 5, 2, 3)
    assert msg.data == np.arange(6, dtype="<f4").tobytes()


def test_q8_message_is_a_quarter_of_f32():
    rows = gemma_sized_rows()
    f32, q8 = (len(frame_to_proto(to_wire(0, rows, w)).SerializeToString()) for w in ("f32", "q8"))
    assert q8 < f32 / 3.9


def test_an_empty_frame_round_trips():
    got = over_the_wire(to_wire(9, torch.zeros(0, 32), "q8"))
    assert got.rows.shape == (0, 32) and got.start == 9


@pytest.mark.parametrize("bad", [
    dict(dtype=stage_pb2.Frame.F32, rows=2, width=3, data=bytes(20)),
    dict(dtype=stage_pb2.Frame.Q8, rows=2, width=3, data=bytes(6)),               # no scales
    dict(dtype=stage_pb2.Frame.F16, rows=2, width=3, data=bytes(12), scales=bytes(4)),
    dict(dtype=stage_pb2.Frame.F32, rows=1, width=1, data=bytes(4), scales=bytes(4)),
    dict(dtype=7, rows=0, width=0),
])
def test_frames_whose_sizes_disagree_are_refused(bad):
    with pytest.raises(MalformedFrame):
        frame_from_proto(stage_pb2.Frame(**bad))


def test_a_decoded_q8_frame_feeds_the_next_stage(smollm2):
    """The receiving torch stage takes a decoded q8 frame as its input rows."""
    from skippy.stages.chain import StageChain
    pipe = StageChain(smollm2, 2, wire_dtype="q8", n_ctx=128)
    lanes = pipe.alloc()
    try:
        out = pipe.stages[0].prefill(lanes[0], torch.tensor([1, 2, 3, 4]), 0, "none")
        assert out.frame.wire_dtype == "q8"
        logits = pipe.stages[1].prefill(lanes[1], over_the_wire(out.frame), 0, "last").logits
        assert torch.isfinite(logits).all()
    finally:
        pipe.free(lanes)


PROMPTS = [
    "The three most useful things to know about the Moon are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


# Measured: one max-abs scale per row loses too much where a row has outlier channels and
# on the attention-sink first row (SmolLM2, layer 15: peak 22,516 against a median of 45):
# `python -m skippy.evals.wire_accuracy` gives 91.3 % top-1 over the corpus. Strict: the
# day q8 passes, this marker must go.
@pytest.mark.xfail(strict=True, reason="q8 (one max-abs/127 scale per row) is not accepted: "
                   "91.3 % top-1 vs the f32 wire on SmolLM2, 2 stages (needs 99 %)")
def test_q8_wire_keeps_top1_on_smollm2_two_stages(smollm2):
    from skippy.evals.wire_accuracy import ACCEPT_TOP1, compare_wire
    from skippy.mesh.tokenizer import Tokenizer
    tok = Tokenizer(smollm2)
    r = compare_wire(smollm2, [tok.encode(p) for p in PROMPTS], "q8", stages=2)
    assert r["top1"] >= ACCEPT_TOP1, r
    assert r["min_cosine"] > 0.99, r


def test_sampling_settings_and_token_logprobs_cross_the_wire_unchanged():
    from skippy.mesh.sampler import SamplingParams, TokenLogprobs
    from skippy.mesh.wire import (sampling_from_proto, sampling_to_proto, token_logprobs,
                                  token_to_proto)

    full = SamplingParams(0.5, 0.75, 40, seed=2**64 - 5, presence_penalty=0.3,
                          frequency_penalty=-1.7, logit_bias=((3, -100.0), (9, 2.25)),
                          logprobs=0)
    for params in (full, SamplingParams()):
        msg = stage_pb2.Sampling.FromString(
            sampling_to_proto(params, [4, 4, 7]).SerializeToString())
        assert sampling_from_proto(msg) == params and list(msg.generated) == [4, 4, 7]
    lp = TokenLogprobs(-0.5, ((5, -0.5), (8, -1.25)))
    msg = stage_pb2.Token.FromString(token_to_proto(5, lp, 12).SerializeToString())
    assert (msg.id, msg.cached_tokens, token_logprobs(msg)) == (5, 12, lp)
    assert token_logprobs(token_to_proto(5, None)) is None
