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


def test_f16_rows_past_f16_range_survive_with_a_power_of_two_scale():
    """Gemma 3's residual stream passes 98,000 on a BOS row; f16 tops out at 65,504."""
    rows = torch.randn(3, 64)
    rows[0] *= 1e5
    back = from_wire(to_wire(0, rows, "f16"))
    assert torch.isfinite(back).all()
    rel = ((back - rows).abs() / rows.abs().amax(dim=1, keepdim=True)).max()
    assert rel < 1e-3
    assert torch.equal(back[1:], rows[1:].half().float())
