"""Q and K normed as whole projections: one RMSNorm over all of a row's query heads and
one over all of its key heads (MiniMax-M2), instead of one per head."""

from __future__ import annotations

import torch

from .layers import rms_norm
from .linear import Linear


class WholeQkNorm:
    """The fused QKV projection followed by the whole-projection norms of its Q and K
    columns: attention then sees rows already normed (and its per-head norm is off)."""

    def __init__(self, qkv: Linear, split: list[int], q_norm: torch.Tensor,
                 k_norm: torch.Tensor, eps: float):
        nq, nk = split[0], split[1]
        if q_norm.numel() != nq or k_norm.numel() != nk:
            raise ValueError(f"whole-projection norms of {q_norm.numel()} and "
                             f"{k_norm.numel()} for Q and K of {nq} and {nk}")
        self.qkv, self.nq, self.nk = qkv, nq, nk
        self.q_norm, self.k_norm, self.eps = q_norm.reshape(-1), k_norm.reshape(-1), eps
        self.out_features, self.in_features = qkv.out_features, qkv.in_features

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        y = self.qkv(h)
        q = rms_norm(y[:, :self.nq].contiguous(), self.q_norm, self.eps)
        k = rms_norm(y[:, self.nq:self.nq + self.nk].contiguous(), self.k_norm, self.eps)
        return torch.cat([q, k, y[:, self.nq + self.nk:]], dim=1)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.q_norm.nbytes + self.k_norm.nbytes
