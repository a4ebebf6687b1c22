"""A layer's Q, K and V projection as llama.cpp builds it (build_qkv): one fused matrix
(attn_qkv) or three, each with an optional bias, then an optional clamp of every value
(OLMo) and RMSNorms over the whole Q and the whole K projection (OLMo 2)."""

from __future__ import annotations

import torch

from skippy.topology.model_config import ModelConfig

from .layers import rms_norm
from .linear import fuse_linear, make_linear
from .weights import StageTensors


class QkvProjection:
    """h -> [n, q | k | v] columns (q: n_heads * head_dim, k: n_kv_heads * head_dim,
    v: n_kv_heads * v_head_dim); per-head norms and rope come after, in Attention."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        fam = cfg.family
        self.q_cols = cfg.n_heads * cfg.head_dim
        self.k_cols = cfg.n_kv_heads * cfg.head_dim
        if p + "attn_qkv.weight" in t.names:
            self.linear = make_linear(t.matrix(p + "attn_qkv.weight"), fmt)
            bias = t.get(p + "attn_qkv.bias")
        else:
            self.linear, _ = fuse_linear([t.matrix(p + f"attn_{x}.weight") for x in "qkv"], fmt)
            bias = None
        if bias is None:
            self.bias = _joined_bias([t.get(p + f"attn_{x}.bias") for x in "qkv"],
                                     self.linear.out_features - self.q_cols - self.k_cols,
                                     self.q_cols, self.k_cols)
        else:
            self.bias = bias
        self.clamp = cfg.clamp_kqv
        self.eps = cfg.rms_eps
        whole = fam.qk_norm and fam.qk_norm_span == "projection"
        self.q_norm = t[p + "attn_q_norm.weight"] if whole else None
        self.k_norm = t[p + "attn_k_norm.weight"] if whole else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        y = self.linear(h)
        if self.bias is not None:
            y = y + self.bias
        if self.clamp > 0:
            y = y.clamp(-self.clamp, self.clamp)
        if self.q_norm is not None:
            qk = self.q_cols + self.k_cols
            y = torch.cat([rms_norm(y[:, :self.q_cols], self.q_norm, self.eps),
                           rms_norm(y[:, self.q_cols:qk], self.k_norm, self.eps),
                           y[:, qk:]], dim=1)
        return y

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this projection."""
        vectors = [v for v in (self.bias, self.q_norm, self.k_norm) if v is not None]
        return self.linear.nbytes + sum(v.nbytes for v in vectors)


def _joined_bias(parts: list[torch.Tensor | None], v_cols: int, q_cols: int,
                 k_cols: int) -> torch.Tensor | None:
    """The separate Q, K, V biases as one vector over the fused output (zeros where a part
    has none: adding 0 leaves a value as it is); None when there are none."""
    if all(b is None for b in parts):
        return None
    sizes = (q_cols, k_cols, v_cols)
    return torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(parts, sizes)])
