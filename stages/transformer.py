"""The decoder layer shared by every family; family quirks come from topology.

A layer is a pre-norm residual block: a token mixer, then a feed-forward block (stages/ffn.py). The mixer is
attention for dense families; hybrid families plug in a recurrent mixer for some layers
(LFM2's short convolution, stages/shortconv.py) or beside attention in every layer
(Falcon-H1's Mamba2, stages/mamba2.py) behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from skippy.topology.model_config import ModelConfig

from . import qkernel
from .kv import LaneKv
from .layers import Rope, attend, causal_mask, rms_norm
from .linear import make_linear
from .norms import Norm, make_norm
from .qkv import QkvProjection
from .softcap import attend_capped
from .weights import StageTensors


@dataclass
class Segment:
    """Rows [row0, row0 + n) of a batch belong to one lane at positions [pos, pos + n)."""

    kv: LaneKv
    row0: int
    n: int
    pos: int
    # Rows [row0, row0 + n_real) are the lane's real rows; the rest pad a short prefill
    # chunk. Causal masking keeps padding out of real rows; recurrent state must skip it.
    n_real: int | None = None
    _windows: dict = field(default_factory=dict)
    # the whole batch's row positions, kept on its first segment (asked by every layer)
    _positions: list[int] | None = None

    def __post_init__(self):
        if self.n_real is None:
            self.n_real = self.n

    def window(self, sliding: int) -> tuple[int, int, torch.Tensor | None]:
        """Key range [lo, hi) and additive mask for this segment's queries."""
        if sliding not in self._windows:
            hi = self.pos + self.n
            lo = max(0, self.pos + 1 - sliding) if sliding else 0
            if self.n == 1:  # one query sees the whole range: no mask needed
                mask = None
            else:
                mask = causal_mask(self.pos, self.n, lo, hi - lo, sliding)
            self._windows[sliding] = (lo, hi, mask)
        return self._windows[sliding]


class Ffn(Protocol):
    def __call__(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The feed-forward block of normed rows h (dense, or a mixture of experts)."""


class Mixer(Protocol):
    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        """Mix normed rows h across each segment's tokens; update the lanes' state."""


class Attention:
    """Grouped-query self-attention over the lane's KV: the mixer of attention layers."""

    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors,
                 fmt: str, rope: Rope):
        p = f"blk.{index}."
        fam = cfg.family
        self.slot, self.cfg, self.rope = slot, cfg, rope  # slot: this layer's KV in LaneKv
        self.window = cfg.sliding_window if cfg.is_swa_layer(index) else 0
        self.qkv = QkvProjection(index, cfg, t, fmt)  # biases, clamp, whole-projection norms
        self.out = make_linear(t.matrix(p + "attn_output.weight"), fmt)
        per_head = fam.qk_norm and fam.qk_norm_span == "head"
        self.q_norm = t[p + "attn_q_norm.weight"] if per_head else None
        self.k_norm = t[p + "attn_k_norm.weight"] if per_head else None
        # Q and K heads side by side ([n, H + KVH, D], adjacent in the QKV output) take
        # their norms and rope in one pass: per element the same arithmetic as separately.
        self.qk_cols = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
        self.qk_norm = None
        if per_head:
            self.qk_norm = torch.cat([self.q_norm.expand(cfg.n_heads, -1),
                                      self.k_norm.expand(cfg.n_kv_heads, -1)]).contiguous()
        self.scale = cfg.attention_scale()
        self.softcap = cfg.attn_softcap  # 0: none (then torch's fused attention)
        self.lib = qkernel.library()
        self.shape = qkernel.AttnShape(
            cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim, rope.dim,
            int(rope.style == "neox"), self.window, cfg.rms_eps, self.scale,
            self.qk_norm.data_ptr() if self.qk_norm is not None else None,
            softcap=self.softcap)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        return self.out(self._attention(self.qkv(h), positions, segments))

    def _attention(self, y: torch.Tensor, positions: torch.Tensor,
                   segments: list[Segment]) -> torch.Tensor:
        """The attention rows [n, heads * v_head_dim] of the QKV projection's output y
        ([n, q | k | v]), before the output projection."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        n = y.shape[0]
        if self.lib is not None and _in_order(segments):
            return self._rows(y, segments)
        qk = y[:, :self.qk_cols].view(n, cfg.n_heads + cfg.n_kv_heads, cfg.head_dim)
        v = y[:, self.qk_cols:].view(n, cfg.n_kv_heads, cfg.v_head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, eps)
        qk = self.rope.apply(qk, positions)
        q, k = qk[:, :cfg.n_heads], qk[:, cfg.n_heads:]
        if len(segments) == 1 and segments[0].n == n:
            attn = self._attend(segments[0], q, k, v)
        else:  # decode batch: padding rows belong to no lane and stay zero
            attn = y.new_zeros(n, cfg.n_heads * cfg.v_head_dim)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                attn[rows] = self._attend(seg, q[rows], k[rows], v[rows])
        return attn

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this mixer."""
        norms = [t for t in (self.q_norm, self.k_norm) if t is not None]
        return self.qkv.nbytes + self.out.nbytes + sum(t.nbytes for t in norms)

    def _rows(self, y: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Every row, decode or prefill, through one call of our kernel (attention.c): norms,
        rope, KV write and attention, each row's arithmetic fixed by its position alone;
        rows past the segments (a decode batch's padding) stay zero."""
        cfg = self.cfg
        pos = _positions(segments)
        self.rope.ensure(max(pos) + 1)
        self.shape.cos, self.shape.sin = self.rope.cos.data_ptr(), self.rope.sin.data_ptr()
        out = y.new_zeros(y.shape[0], cfg.n_heads * cfg.v_head_dim)
        qkernel.attend_rows(self.lib, self.shape, y.contiguous(), len(pos), pos,
                              [s.kv.k[self.slot] for s in segments for _ in range(s.n)],
                              [s.kv.v[self.slot] for s in segments for _ in range(s.n)], out)
        return out

    def _attend(self, seg: Segment, q, k, v) -> torch.Tensor:
        seg.kv.write(self.slot, seg.pos, k, v)
        lo, hi, mask = seg.window(self.window)
        if self.softcap:
            return attend_capped(q, seg.kv.keys(self.slot, lo, hi),
                                 seg.kv.values(self.slot, lo, hi), mask, self.scale, self.softcap)
        return attend(q, seg.kv.keys(self.slot, lo, hi), seg.kv.values(self.slot, lo, hi),
                      mask, self.scale)


class DecoderLayer:
    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, mixer: Mixer, ffn: Ffn):
        p = f"blk.{index}."
        fam = cfg.family
        self.index, self.cfg, self.mixer, self.ffn = index, cfg, mixer, ffn
        # the mixer's input norm (LFM2: operator_norm); None: the family norms no input
        self.attn_norm = make_norm(cfg, t, p + "attn_norm.weight") if fam.pre_norms else None
        self.post_attn_norm = make_norm(cfg, t, p + "post_attention_norm.weight") \
            if fam.post_norms else None
        # Falcon-H1 files as llama.cpp loads them name it "blk.N.ffn_norm" (no ".weight")
        name = p + fam.ffn_norm if p + fam.ffn_norm in t.names else p + "ffn_norm.weight"
        self.ffn_norm = make_norm(cfg, t, name) if fam.pre_norms else None
        self.post_ffn_norm = make_norm(cfg, t, p + "post_ffw_norm.weight") \
            if fam.post_norms else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                segments: list[Segment]) -> torch.Tensor:
        h = self.mixer(_normed(self.attn_norm, x), positions, segments)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.ffn(_normed(self.ffn_norm, x), segments)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


def _in_order(segments: list[Segment]) -> bool:
    """Do the segments take rows 0, 1, ... in order (a prefill chunk, a decode batch)?"""
    row = 0
    for s in segments:
        if s.row0 != row:
            return False
        row += s.n
    return True


def _positions(segments: list[Segment]) -> list[int]:
    """Each row's position, for rows in order."""
    first = segments[0]
    if first._positions is None:
        first._positions = [p for s in segments for p in range(s.pos, s.pos + s.n)]
    return first._positions


def _normed(norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)
