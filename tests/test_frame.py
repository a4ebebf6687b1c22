"""Activation frames on the wire."""

import torch

from skippy.stages.frame import from_wire, to_wire


def test_f32_wire_is_lossless():
    rows = torch.randn(5, 64) * 1e6
    assert torch.equal(from_wire(to_wire(3, rows, "f32")), rows)


def test_f16_rows_in_range_are_plain_f16():
    rows = torch.randn(4, 64) * 100
    frame = to_wire(0, rows, "f16")
    assert torch.equal(frame.rows, rows.half())
    assert torch.equal(frame.scale, torch.ones(4))


def test_f16_scales_a_row_from_2_to_the_15_on_and_no_row_below_it():
    """Frames wholly in range take a shorter way (scale 1, no per-row exponent): the
    boundary and non-finite rows come out as the per-row rule says either way."""
    rows = torch.zeros(4, 8)
    rows[0, 0], rows[1, 0], rows[2, 0], rows[3, 0] = 32767.0, 32768.0, float("nan"), -1e9
    assert to_wire(0, rows, "f16").scale.tolist() == [1.0, 2.0, 1.0, 2.0 ** 15]
    assert to_wire(0, rows[:1], "f16").scale.tolist() == [1.0]
    assert to_wire(0, rows[2:3], "f16").scale.tolist() == [1.0]


def test_f16_rows_past_f16_range_survive_with_a_power_of_two_scale():
    """Gemma 3's residual stream passes 98,000 on a BOS row; f16 tops out at 65,504."""
    rows = torch.randn(3, 64)
    rows[0] *= 1e5
    back = from_wire(to_wire(0, rows, "f16"))
    assert torch.isfinite(back).all()
    rel = ((back - rows).abs() / rows.abs().amax(dim=1, keepdim=True)).max()
    assert rel < 1e-3
    assert torch.equal(back[1:], rows[1:].half().float())


def test_q8_rows_are_int8_with_one_max_abs_scale_per_row():
    rows = torch.randn(4, 64) * torch.tensor([[1.0], [1e5], [1e-3], [30.0]])
    frame = to_wire(2, rows, "q8")
    assert frame.rows.dtype == torch.int8 and frame.wire_dtype == "q8"
    assert torch.equal(frame.scale, rows.abs().amax(dim=1) / 127)
    assert frame.rows.abs().amax(dim=1).tolist() == [127] * 4
    err = (from_wire(frame) - rows).abs().amax(dim=1)
    assert (err <= frame.scale * 0.5001).all()  # half a step per value


def test_q8_zero_row_is_sent_as_zeros():
    rows = torch.zeros(2, 8)
    rows[1, 3] = -2.0
    frame = to_wire(0, rows, "q8")
    assert torch.isfinite(frame.scale).all()
    assert torch.equal(from_wire(frame), rows)


def test_unknown_wire_dtype_is_refused():
    import pytest
    with pytest.raises(ValueError, match="q8"):
        to_wire(0, torch.zeros(1, 4), "bf16")


def test_our_kernel_gives_torchs_f16_bits_both_ways(monkeypatch):
    """to_wire and from_wire run on our kernel where it is built: the same bits as torch's
    ops (ties to even, subnormal halves, -0, the range's edge), and any row it cannot send
    at scale 1 still takes the per-row rule."""
    from skippy.stages import qkernel
    if qkernel.library() is None:
        return  # no C compiler: torch's ops are the only path
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 96, generator=g) * torch.tensor([1e-7, 1e-5, 1.0, 1e3, 5e3, 1.0])[:, None]
    rows[2, :4] = torch.tensor([-0.0, 32767.99, -32767.99, 2.0 ** -25])
    edge = rows.clone()
    edge[5, 0] = 32768.0  # a row past the edge: the whole frame takes the per-row rule
    ours = [to_wire(0, r, "f16") for r in (rows, edge)]
    back = [from_wire(f) for f in ours]
    monkeypatch.setattr(qkernel, "library", lambda: None)
    theirs = [to_wire(0, r, "f16") for r in (rows, edge)]
    for a, b, x in zip(ours, theirs, back):
        assert torch.equal(a.rows.view(torch.int16), b.rows.view(torch.int16))
        assert torch.equal(a.scale, b.scale)
        assert torch.equal(x.view(torch.int32), from_wire(b).view(torch.int32))
    assert ours[0].scale.tolist() == [1.0] * 6 and ours[1].scale[5] == 2.0


def test_a_decode_rows_scales_are_shared_and_never_sent():
    from skippy.mesh.wire import frame_from_proto, frame_to_proto
    from skippy.stages.frame import is_unit_scale
    frame = to_wire(7, torch.randn(1, 64), "f16")
    assert is_unit_scale(frame.scale) and not is_unit_scale(torch.ones(1))
    msg = frame_to_proto(frame)
    assert not msg.scales
    back = frame_from_proto(msg)
    assert is_unit_scale(back.scale) and torch.equal(back.rows, frame.rows)
    big = to_wire(0, torch.randn(100, 8), "f16")  # past the shared sizes: its own ones
    assert not is_unit_scale(big.scale) and not frame_to_proto(big).scales
