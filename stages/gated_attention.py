"""Attention with a per-head output gate carried by the Q projection (Qwen3-Next).

attn_q gives each head 2 * head_dim values: its query, then its gate. The query goes
through the usual q norm, rope and attention; the attention rows are multiplied by
sigmoid(gate) before the output projection (llama_model_qwen3next::graph::build_layer_attn).
The sigmoid is rowops.c's where our kernels are built (torch's rounds a vector's body and
its tail differently: a gate's bits would depend on where the call's rows put it).
"""

from __future__ import annotations

import torch

from . import qkernel
from .transformer import Attention, Segment


class GatedAttention(Attention):
    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        y = self.qkv(h)
        cols = 2 * cfg.n_heads * cfg.head_dim
        q_gate = y[:, :cols].view(n, cfg.n_heads, 2, cfg.head_dim)
        # the plain attention's [q | k | v] rows, the gates set aside
        y = torch.cat([q_gate[:, :, 0].reshape(n, -1), y[:, cols:]], dim=-1)
        gate = q_gate[:, :, 1].reshape(n, -1)
        gate = torch.sigmoid(gate) if self.lib is None else qkernel.gate(self.lib, gate,
                                                                         "sigmoid")
        return self.out(self._attention(y, positions, segments) * gate)
