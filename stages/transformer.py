"""The decoder layer shared by every dense family; family quirks come from topology."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from skippy.topology.model_config import ModelConfig

from .kv import LaneKv
from .layers import Rope, attend, causal_mask, gated_activation, rms_norm
from .linear import fuse_linear, make_linear
from .weights import StageTensors


@dataclass
class Segment:
    """Rows [row0, row0 + n) of a batch belong to one lane at positions [pos, pos + n)."""

    kv: LaneKv
    row0: int
    n: int
    pos: int
    _windows: dict = field(default_factory=dict)

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


class DecoderLayer:
    def __init__(self, index: int, local: int, cfg: ModelConfig, t: StageTensors,
                 fmt: str, rope: Rope):
        p = f"blk.{index}."
        fam = cfg.family
        self.local, self.cfg, self.rope = local, cfg, rope
        self.window = cfg.sliding_window if cfg.is_swa_layer(index) else 0
        self.attn_norm = t[p + "attn_norm.weight"]
        self.qkv, self.qkv_split = fuse_linear(
            [t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]], fmt)
        self.out = make_linear(t[p + "attn_output.weight"], fmt)
        self.q_norm = t[p + "attn_q_norm.weight"] if fam.qk_norm else None
        self.k_norm = t[p + "attn_k_norm.weight"] if fam.qk_norm else None
        self.post_attn_norm = t[p + "post_attention_norm.weight"] if fam.post_norms else None
        self.ffn_norm = t[p + "ffn_norm.weight"]
        self.gate_up, self.gate_up_split = fuse_linear(
            [t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]], fmt)
        self.down = make_linear(t[p + "ffn_down.weight"], fmt)
        self.post_ffn_norm = t[p + "post_ffw_norm.weight"] if fam.post_norms else None
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                segments: list[Segment]) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_eps
        n = x.shape[0]
        h = rms_norm(x, self.attn_norm, eps)
        q, k, v = self.qkv(h).split(self.qkv_split, dim=-1)
        q = q.view(n, cfg.n_heads, cfg.head_dim)
        k = k.view(n, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.n_kv_heads, cfg.v_head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q = self.rope.apply(q, positions)
        k = self.rope.apply(k, positions)
        if len(segments) == 1 and segments[0].n == n:
            attn = self._attend(segments[0], q, k, v)
        else:  # decode batch: padding rows belong to no lane and stay zero
            attn = x.new_zeros(n, cfg.n_heads * cfg.v_head_dim)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                attn[rows] = self._attend(seg, q[rows], k[rows], v[rows])
        h = self.out(attn)
        if self.post_attn_norm is not None:
            h = rms_norm(h, self.post_attn_norm, eps)
        x = x + h
        h = rms_norm(x, self.ffn_norm, eps)
        gate, up = self.gate_up(h).split(self.gate_up_split, dim=-1)
        h = self.down(gated_activation(gate, up, cfg.family.activation))
        if self.post_ffn_norm is not None:
            h = rms_norm(h, self.post_ffn_norm, eps)
        return x + h

    def _attend(self, seg: Segment, q, k, v) -> torch.Tensor:
        seg.kv.write(self.local, seg.pos, k, v)
        lo, hi, mask = seg.window(self.window)
        return attend(q, seg.kv.keys(self.local, lo, hi), seg.kv.values(self.local, lo, hi),
                      mask, self.scale)
