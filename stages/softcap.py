"""Soft-capping (Gemma 2): cap * tanh(x / cap) on attention scores before the mask and
softmax, and on the head's logits. torch's fused attention cannot cap its scores, so capped
layers attend in explicit steps: scores, cap, mask, softmax, values."""

from __future__ import annotations

import numpy as np
import torch

from . import qkernel


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x * (1 / cap)), with 1 / cap rounded to float as llama.cpp rounds it:
    float32 rows in our kernel where it is built (rowops.c: a fixed tanh, in one pass),
    else torch's ops."""
    inv = float(np.float32(1.0) / np.float32(cap))  # a float32 division, as torch's
    lib = qkernel.library()
    if lib is not None and x.dtype == torch.float32:
        return qkernel.soft_cap(lib, x, inv, cap)
    return torch.tanh(x * inv) * cap


def attend_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
    """layers.attend with the scores capped. q: [T, H, D]; k: [L, KVH, D];
    v: [L, KVH, Dv]; mask: additive [T, L] or None. Returns [T, H * Dv].
    Q is scaled before the product, as llama.cpp scales it (Gemma 2's Qcur)."""
    T, H, D = q.shape
    L, KVH, Dv = v.shape
    g = H // KVH  # the query heads of one KV head lie side by side
    qh = (q * scale).transpose(0, 1).reshape(KVH, g * T, D)
    scores = soft_cap(torch.bmm(qh, k.permute(1, 2, 0)), cap).view(H, T, L)
    if mask is not None:
        scores = scores + mask
    p = torch.softmax(scores, dim=-1).view(KVH, g * T, L)
    out = torch.bmm(p, v.permute(1, 0, 2)).view(H, T, Dv)
    return out.transpose(0, 1).reshape(T, H * Dv)
