"""The short-convolution token mixer of LFM2's recurrent layers.

in_proj splits into gates B, C and input x; the depthwise causal convolution runs over
B * x along time with a kernel of l_cache taps per channel; C gates its output; out_proj
maps back. A row sees the l_cache - 1 rows before it, so a lane carries those rows
(its conv state) from one chunk or decode step to the next.

Everything between the two projections is elementwise (the conv through scan.c where our
kernels are built: one call instead of a few torch ops per tap, with the same bits): a
row's bits depend only on its own inputs and on the state, never on how many rows ran
beside it (DESIGN.md §5.3).
"""

from __future__ import annotations

import torch

from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import causal_conv, conv_taps
from .linear import make_linear
from .weights import StageTensors


class ShortConv:
    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}.shortconv."
        self.slot, self.hidden = slot, cfg.hidden  # slot: this layer's conv state in LaneKv
        self.in_proj = make_linear(t.matrix(p + "in_proj.weight"), fmt)
        self.out_proj = make_linear(t.matrix(p + "out_proj.weight"), fmt)
        self.taps = conv_taps(t[p + "conv.weight"], p + "conv.weight", cfg.hidden,
                              cfg.conv_l_cache)
        self.d_conv = cfg.conv_l_cache - 1
        self.lib = qkernel.library()
        self.tap_rows = torch.stack(self.taps).float().contiguous()  # [l_cache, hidden]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        n = h.shape[0]
        b, c, x = self.in_proj(h).split(self.hidden, dim=-1)
        bx = b * x
        if len(segments) == 1 and segments[0].n == n:
            conv = self._conv(segments[0], bx)
        else:  # decode batch: padding rows belong to no lane, stay zero, touch no state
            conv = h.new_zeros(n, self.hidden)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                conv[rows] = self._conv(seg, bx[rows])
        return self.out_proj(c * conv)

    @property
    def row_invariant(self) -> bool:
        """Elementwise between the projections: a row's bits are its own on either path
        (the projections' format decides the rest: linear.row_invariant)."""
        return True

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this mixer."""
        return self.in_proj.nbytes + self.out_proj.nbytes + sum(t.nbytes for t in self.taps)

    def _conv(self, seg, bx: torch.Tensor) -> torch.Tensor:
        n, state = bx.shape[0], seg.kv.conv[self.slot]
        if self.lib is not None:
            out = qkernel.scan_conv(self.lib, state, bx, self.tap_rows)
        else:
            out = causal_conv(torch.cat([state, bx]), self.taps, n)
        # The new state ends at the last real row: rows padding a short chunk sit after it
        # and must not enter the state (a resumed lane would otherwise differ from a cold one).
        seg.kv.conv[self.slot] = conv_state(state, bx, seg.n_real)
        return out


def conv_state(state: torch.Tensor, rows: torch.Tensor, end: int) -> torch.Tensor:
    """A conv state moved on by rows [0, end): the last len(state) rows of [state; rows[:end]],
    a new tensor (snapshots hold the old one)."""
    d = state.shape[0]
    if end >= d:
        return rows[end - d:end].clone()
    return torch.cat([state[end:], rows[:end]])
