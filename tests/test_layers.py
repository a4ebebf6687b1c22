"""Shared transformer pieces: the rotary embedding turns each pair by the written formula."""

from __future__ import annotations

import pytest
import torch

from skippy.stages.layers import Rope


def rotated_by_formula(rope: Rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(x0 cos - x1 sin, x0 sin + x1 cos) per pair: adjacent pairs ("norm") or halves
    ("neox"), the rest of the head passed through."""
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    rot, rest = x[..., :rope.dim], x[..., rope.dim:]
    if rope.style == "norm":
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    else:
        x0, x1 = rot[..., :rope.dim // 2], rot[..., rope.dim // 2:]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("dim,head_dim", [(64, 64), (32, 64), (256, 256)])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_rope_gives_the_formulas_floats(style, dim, head_dim, rows):
    torch.manual_seed(rows)
    rope = Rope(dim, 10000.0, 1.0, style)
    x = torch.randn(rows, 12, head_dim) * 5
    positions = torch.arange(1000, 1000 + rows)
    assert torch.equal(rope.apply(x, positions), rotated_by_formula(rope, x, positions))
    # the tables are looked up once per positions tensor, and again for a new one
    later = torch.arange(2000, 2000 + rows)
    assert torch.equal(rope.apply(x, later), rotated_by_formula(rope, x, later))
